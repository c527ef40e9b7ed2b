"""Several people on one server, as they meet it: real Ray Serve over HTTP, the official SDKs.

One app (one Serve start for the whole module): inference keys A and B (each its own tenant), a
named tenant "team" with two keys, and an admin key. A second app at /broken is deployed with a key
source that yields no key: it must not start.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from api.service.settings import KeyConfigError
from e2e_helpers import tiny_args, wait_healthy
from reliability_helpers import deploy, own_cluster, token_prompt

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
A, B, C1, C2, ADMIN = "sk-tenant-a-01", "sk-tenant-b-02", "sk-team-c1-03", "sk-team-c2-04", "sk-admin-05"
ADMIN_ROUTES = [("GET", "/admin/requests"), ("GET", "/admin/cache"), ("POST", "/admin/cache/clear"),
                ("POST", "/admin/cache/flush"), ("POST", "/admin/reset"), ("GET", "/admin/models"),
                ("GET", "/metrics")]


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    args = tiny_args(tiny_model_dir, api_keys=[A, B], admin_api_keys=[ADMIN], tenants={"team": [C1, C2]},
                     responses={"directory": str(tmp_path_factory.mktemp("responses"))},
                     limits={"max_stop_chars": 64})
    with own_cluster({"/": args}, apple_silicon=1) as url:
        wait_healthy(url)
        yield url


def oai(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def stored_by(client: openai.OpenAI) -> str:
    response = client.responses.create(model="tiny", input="Remember the word pineapple.", max_output_tokens=4)
    assert response.id.startswith("resp_")
    return response.id


def test_a_stored_response_is_404_to_another_tenant(base):
    a, b = oai(base, A), oai(base, B)
    rid = stored_by(a)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(rid)
    with pytest.raises(openai.NotFoundError) as follow_up:
        b.responses.create(model="tiny", input="And now?", previous_response_id=rid, max_output_tokens=4)
    assert follow_up.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(rid)
    # Still A's, untouched by B's delete: A reads, lists, continues it.
    assert a.responses.retrieve(rid).id == rid
    assert a.responses.input_items.list(rid).data
    assert a.responses.create(model="tiny", input="And now?", previous_response_id=rid, max_output_tokens=4).id
    # An admin key is no inference key: it reads nobody's responses.
    with pytest.raises(openai.PermissionDeniedError):
        oai(base, ADMIN).responses.retrieve(rid)
    a.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(rid)


def test_keys_of_one_named_tenant_share_its_responses(base):
    c1, c2 = oai(base, C1), oai(base, C2)
    rid = stored_by(c1)
    assert c2.responses.retrieve(rid).id == rid
    assert c2.responses.create(model="tiny", input="Which word?", previous_response_id=rid, max_output_tokens=4).id
    with pytest.raises(openai.NotFoundError):
        oai(base, A).responses.retrieve(rid)


def test_an_inference_key_gets_403_on_every_admin_route(base):
    for method, path in ADMIN_ROUTES:
        for key in (A, C1):
            r = httpx.request(method, f"{base}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert r.status_code == 403, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "permission_error" and "admin key" in error["message"], error
        assert httpx.request(method, f"{base}{path}", timeout=60).status_code == 401
    for path in ("/admin/requests", "/admin/cache", "/metrics"):
        assert httpx.get(f"{base}{path}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60).status_code == 200
    # And the admin key is no inference key, in either SDK.
    with pytest.raises(openai.PermissionDeniedError):
        oai(base, ADMIN).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
    claude = anthropic.Anthropic(base_url=base, api_key=ADMIN, max_retries=0, timeout=60)
    with pytest.raises(anthropic.PermissionDeniedError):
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_unknown_paths_are_one_metrics_label(base):
    for i in range(30):
        assert httpx.get(f"{base}/guess-{i}", timeout=30).status_code == 401
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    assert "guess-" not in text
    assert 'pomona_requests_total{route="other",status="401"}' in text


def test_a_long_stop_string_is_a_400_naming_stop(base):
    with pytest.raises(openai.BadRequestError) as refused:
        oai(base, A).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, stop=["x" * 65])
    assert refused.value.body["param"] == "stop" and "at most 64 characters" in refused.value.body["message"]


def cached(client: openai.OpenAI, prompt: list[int]) -> int:
    usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0).usage
    return usage.prompt_tokens_details.cached_tokens


def test_a_tenant_hits_its_own_cached_prefix(base):
    prompt = token_prompt(160, salt=11)
    assert cached(oai(base, A), prompt) == 0
    assert cached(oai(base, A), prompt) >= 128
    shared = token_prompt(160, salt=12)
    assert cached(oai(base, C1), shared) == 0
    assert cached(oai(base, C2), shared) >= 128  # one named tenant: one cache


def test_the_cached_token_probe_sees_nothing_across_tenants(base):
    """Tenant B asking A's prompt learns nothing: no cached tokens (and no cache-hit timing)."""
    prompt = token_prompt(160, salt=21)
    assert cached(oai(base, A), prompt) == 0
    assert cached(oai(base, A), prompt) >= 128  # a hit within the tenant
    assert cached(oai(base, B), prompt) == 0  # none across
    assert cached(oai(base, C1), prompt) == 0


def test_a_key_source_that_yields_no_key_stops_the_app(base, tmp_path, tiny_model_dir):
    empty = tmp_path / "keys"
    empty.write_text("# the team's keys go here\n\n")
    with pytest.raises(KeyConfigError, match=r"api_keys_file .* holds no key .*add one key per line"):
        deploy("/broken", tiny_args(tiny_model_dir, api_keys_file=str(empty)))
    assert httpx.get(f"{base}/broken/health", timeout=10).status_code != 200
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # the running app is untouched
