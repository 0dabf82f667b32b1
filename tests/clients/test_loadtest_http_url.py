"""shoal-load -i http takes the server's URL as people write it: with a trailing slash too."""

from __future__ import annotations

from shoal.clients.loadtest.http import HttpControl
from tests.conftest import RunningServer


def test_a_url_with_a_trailing_slash_reaches_the_server(example_server: RunningServer) -> None:
    for url in (example_server.http_url, example_server.http_url + "/", "http://" + example_server.http_url + "/"):
        control = HttpControl(url)
        assert control.server_metadata().name == "shoal", url
        assert control.model_metadata("simple").name == "simple", url
