"""A response whose head came from upstream, turned into a refusal (addons/respond.py
`replace_response`): the same headers as every other refusal, and the upstream's body dropped."""

from mitmproxy import http

from addons.respond import default_page, refusal_headers, replace_response
from gateway.decision import Decision


def _upstream_response() -> http.Response:
    return http.Response.make(200, b"", {"Content-Type": "application/json", "Set-Cookie": "s=1",
                                         "Content-Length": "1000"})


def test_the_head_is_the_refusal_and_nothing_of_the_upstream_head_stays():
    decision = Decision.deny("response_too_large", "the decoded body is over its budget", rule="model-api")
    response = _upstream_response()
    replace_response(response, decision, default_page(decision))
    body = decision.body().encode()
    assert response.status_code == decision.status == 502
    assert response.reason == "Bad Gateway"
    assert dict(response.headers) == refusal_headers(decision) | {"Content-Length": str(len(body))}
    assert response.headers["X-Egress-Rule"] == "model-api"
    assert "Set-Cookie" not in response.headers


def test_the_upstream_body_is_dropped_and_the_refusal_sent_once():
    decision = Decision.deny("undecodable_response", "the response could not be decoded")
    response = _upstream_response()
    replace_response(response, decision, default_page(decision))
    pieces = [response.stream(b"secret upstream bytes"), response.stream(b"more"), response.stream(b"")]
    assert pieces == [decision.body().encode(), b"", b""]
