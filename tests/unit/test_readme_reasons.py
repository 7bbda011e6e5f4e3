"""Every reason code the gateway can send is documented in README.md's table."""

from pathlib import Path

from gateway.decision import REASONS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_reason_code_is_in_the_readme():
    section = README.split("## Reason codes", 1)[1].split("\n## ", 1)[0]
    missing = [code for code in REASONS if code != "allowed" and f"`{code}`" not in section]
    assert missing == []
