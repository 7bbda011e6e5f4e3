"""Real parts for end-to-end tests: a CA made at run time, recording upstream servers, a gateway process."""
