"""The method a request is judged by: the method on the wire and every method override in it.

Web frameworks and large APIs let a request name another method than the one it is sent with, for
clients (HTML forms, old proxies, App Engine, Flash) that can only send GET and POST:

| convention | who honours it |
|---|---|
| header `X-HTTP-Method-Override` | Google APIs and GData, OneDrive/Microsoft Graph, Django REST framework (on any method), Rack/Rails, Symfony/Laravel, Express `method-override`, ASP.NET Core, Yii, CakePHP, Slim, Ktor, gorilla/handlers, Scalatra, Catalyst |
| header `X-HTTP-Method` | OData and SharePoint, Express `method-override` (configured), ArangoDB |
| header `X-Method-Override` | Express `method-override` (configured), ArangoDB |
| query or form field `_method` (any case: `_METHOD` is Slim's) | Rails/Rack (form body; older Rack also the query), Laravel and Symfony (body, then query), Spring `HiddenHttpMethodFilter` (query and form), Express `method-override` (query or body), gorilla (`FormValue`: query and body), Trillium, Scalatra, CakePHP, Yii, PAGI |
| JSON key `_method` / `_METHOD` | Laravel (its input bag is the JSON body), Slim (parsed body), Express getters reading `req.body._method` |
| query field `_method_override` | Haskell wai-extra |
| query field `method` | Akka HTTP `overrideMethodWithParameter("method")` (its documented name) |

Some honour an override only on POST, some on any method (DRF, ArangoDB, Ktor, Akka, Yii's header,
phapi's GET overrides), so the gateway judges overrides on every method: a request is allowed only
if its wire method **and every method any override names** are allowed by the rule. Overrides are
never stripped and let through: a server may read the same field from the body, where the gateway
cannot strip it without rewriting the body.

Spellings, as upstreams read them: header names case-insensitively with every non-alphanumeric
character as `-` (CGI, WSGI and PHP turn `X_HTTP_Method_Override` and `X.HTTP.Method.Override`
into `HTTP_X_HTTP_METHOD_OVERRIDE`); query and form names like
gateway/foreign.py (percent-decoded, case-folded, `.`, `-` and space as `_`, `[...]` array suffixes
dropped). Values are percent-decoded (query and form), trimmed and upper-cased (frameworks upper-case
overrides), split at commas (Express takes the first element of `GET, DELETE`, others the whole):
every element counts. A value under one of the override names that is not a method token at all
(`DELETE;x`, a NUL, non-ASCII) is refused too: no client needs one, and what a server makes of it is
not knowable. An empty value is no override. The generic name `method` (query only) counts only when
its value is a registered method name (`?method=flickr.photos.search` is an API's own parameter).

Pure: `overrides` finds them in headers and the request target; `refused` says which one the rule
does not allow; `BodyScanner` (below) finds them in urlencoded, multipart and JSON bodies, fed
chunk by chunk, read as a superset of every framework's reading (or says why it cannot: `problem`).

Bodies are read as a SUPERSET of what any mainstream framework could read a `_method` field from
(docs/policy.md "Method overrides"): every plausible reading of its Content-Type, every plausible
charset, the bytes as sent and decoded, multipart as liberally as PHP and Rack. A reading that
finds an override the rule does not allow refuses the body; a body the gateway cannot read under
some plausible reading (an unknown charset, a Content-Encoding that does not decode) is refused as
uncheckable (`BodyScanner.problem`).

One concern a module: `overrides` (the head: headers and query, and the audit line's entries),
`body_plan` (a body's readings from its Content-Type), `fields` (one field's name and value read
every way, and the caps), `form`, `multipart` and `json_keys` (the parsers), `name_filter` (the
form scan's fast paths), `scanner` (`BodyScanner`: the streams, readings and decoders around them).
"""

from .body_plan import READINGS_CAP, BodyPlan, plan_body
from .fields import LONG_HEAD, NAME_CAP, SLOW_FIELDS_CAP, VALUE_CAP
from .overrides import (DESCRIBED_CAP, FIELD_KEYS, GENERIC_FIELDS, GENERIC_KEYS, HEADER_KEYS, KNOWN_METHODS,
                        MAX_ELEMENTS, NOT_A_METHOD, OVERRIDE_FIELDS, OVERRIDE_HEADERS, SOURCES, Override, described,
                        described_query_overrides, field_overrides, forbidden, header_overrides, overrides,
                        override_header_key, parse_described, query_overrides, refused)
from .scanner import CODINGS_CAP, SCAN_PIECE, BodyScanner, BodyTooLarge, body_parsers

__all__ = [
    "CODINGS_CAP", "DESCRIBED_CAP", "FIELD_KEYS", "GENERIC_FIELDS", "GENERIC_KEYS", "HEADER_KEYS", "KNOWN_METHODS",
    "LONG_HEAD", "MAX_ELEMENTS", "NAME_CAP", "NOT_A_METHOD", "OVERRIDE_FIELDS", "OVERRIDE_HEADERS", "READINGS_CAP",
    "SCAN_PIECE", "SLOW_FIELDS_CAP", "SOURCES", "VALUE_CAP", "BodyPlan", "BodyScanner", "BodyTooLarge", "Override",
    "body_parsers", "described", "described_query_overrides", "field_overrides", "forbidden", "header_overrides",
    "override_header_key", "overrides", "parse_described", "plan_body", "query_overrides", "refused",
]
