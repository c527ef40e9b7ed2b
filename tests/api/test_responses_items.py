"""`GET /v1/responses/{id}/input_items` through the official openai SDK's
`client.responses.input_items.list`, on the real app and engine in process (tiny model)."""

from __future__ import annotations

import pytest

from api.responses.render import item_page
from test_responses_api import run_app
from test_responses_parse import WEATHER_TOOL

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FIRST_INPUT = [{"role": "developer", "content": "Answer with tools."},
               {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]


def test_input_items_list_a_chain_in_order_and_page(tiny_model_dir, tmp_path):
    async def body(client, http):
        first = await client.responses.create(
            model="tiny", input=FIRST_INPUT, tools=[WEATHER_TOOL], max_output_tokens=200, temperature=0,
            tool_choice={"type": "function", "name": "get_weather"})
        call = first.output[-1]
        second = await client.responses.create(
            model="tiny", previous_response_id=first.id, tools=[WEATHER_TOOL], max_output_tokens=4,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}])
        lists = {
            "first": [i async for i in client.responses.input_items.list(first.id)],
            "asc": [i async for i in client.responses.input_items.list(second.id, order="asc")],
            "desc": [i async for i in client.responses.input_items.list(second.id)],
            "paged": [i async for i in client.responses.input_items.list(second.id, limit=1)],  # 4 pages
        }
        raw = (await http.get(f"/v1/responses/{second.id}/input_items", params={"limit": 2, "order": "asc"})).json()
        rest = (await http.get(f"/v1/responses/{second.id}/input_items",
                               params={"order": "asc", "after": raw["last_id"]})).json()
        refusals = []
        for rid, params in [("resp_" + "0" * 32, {}), (second.id, {"limit": 0}), (second.id, {"order": "up"}),
                            (second.id, {"after": "msg_unknown"})]:
            refusals.append(await http.get(f"/v1/responses/{rid}/input_items", params=params))
        return first, second, lists, raw, rest, refusals
    first, second, lists, raw, rest, refusals = run_app(tiny_model_dir, tmp_path, body)
    assert [(i.type, i.role) for i in lists["first"]] == [("message", "user"), ("message", "system")]
    assert lists["first"][0].content[0].text == "Weather in Paris?"
    asc = lists["asc"]
    assert [i.type for i in asc] == ["message", "message", "function_call", "function_call_output"]
    assert [i.id for i in asc[:2]] == [i.id for i in lists["first"][::-1]]  # the predecessor's own items
    assert asc[2].id == first.output[-1].id and asc[2].call_id == asc[3].call_id == first.output[-1].call_id
    assert asc[3].output == '{"temp_c": 18}'
    assert [i.id for i in lists["desc"]] == [i.id for i in asc[::-1]] == [i.id for i in lists["paged"]]
    assert raw["object"] == "list" and raw["has_more"] is True and len(raw["data"]) == 2
    assert (raw["first_id"], raw["last_id"]) == (asc[0].id, asc[1].id)
    assert [i["id"] for i in rest["data"]] == [i.id for i in asc[2:]] and rest["has_more"] is False
    assert [r.status_code for r in refusals] == [404, 400, 400, 400]
    assert [r.json()["error"]["param"] for r in refusals] == ["response_id", "limit", "order", "after"]


def test_item_page_bounds():
    items = [{"id": f"i{k}"} for k in range(5)]
    page = item_page(items, 2, "desc", "i3")
    assert [i["id"] for i in page["data"]] == ["i2", "i1"] and page["has_more"] is True
    last = item_page(items, 2, "asc", "i3")
    assert [i["id"] for i in last["data"]] == ["i4"] and last["has_more"] is False
    assert item_page([], 20, "desc", None) == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                               "has_more": False}
    assert item_page(items, 2, "asc", "nope") is None
