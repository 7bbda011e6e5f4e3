"""Subcommands of `egress-gateway`. Each module here defines `register(subparsers)`, which adds
its parser and sets `func` (returning the exit status); the CLI finds them all by itself.

Exit statuses shared by every subcommand: 0 ok, 1 runtime failure or failed checks, 2 bad input
(an invalid policy or file).
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
