"""GET /debug/requests/{id} (minisched/serve/debug.py): the story of a recent request, by the server's call
id or the client's X-Request-Id, behind the API key; an unknown id is a 404 in OpenAI's error shape."""

from __future__ import annotations

import httpx

from helpers.serve import TINY, running_server
from minisched.engine import Engine


def test_a_recent_requests_story_by_client_id_and_call_id():
    engine = Engine(TINY, num_pages=64, page_size=4, chunk_size=16)
    with running_server(engine, api_key="k") as live, httpx.Client(base_url=live.url, timeout=60) as c:
        auth = {"Authorization": "Bearer k"}
        r = c.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": [5] * 40, "max_tokens": 4, "n": 2},
            headers={**auth, "X-Request-Id": "client-42"},
        )
        assert r.status_code == 200, r.text
        call_id = r.json()["id"]
        assert c.get("/debug/requests/client-42").status_code == 401  # behind the key
        d = c.get("/debug/requests/client-42", headers=auth)
        assert d.status_code == 200, d.text
        body = d.json()
        stories = {r["rid"]: r["story"] for r in body["requests"]}
        # n = 2: the shared prompt's prefill (chunked), then the two choices that waited for it
        assert body["call_id"] == call_id and set(stories) == {f"{call_id}-0#prompt", f"{call_id}-0", f"{call_id}-1"}
        assert "chunk 1 of 3" in stories[f"{call_id}-0#prompt"]
        for j in range(2):
            story = stories[f"{call_id}-{j}"]
            assert "arrived" in story and "shared prefill had not ended" in story and "finished" in story
        assert body["requests"][0]["segments"][0]["text"] == "arrived"
        assert c.get(f"/debug/requests/{call_id}", headers=auth).json()["requests"] == body["requests"]
        missing = c.get("/debug/requests/nope", headers=auth)
        assert missing.status_code == 404 and "no recent request" in missing.json()["error"]["message"]
