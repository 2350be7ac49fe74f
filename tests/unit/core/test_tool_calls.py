"""The one ``<tool_call>`` reader, as the default agent and the gateway both use it."""

from rlbus.agent import parse_tool_call
from rlbus.rollout.sessions import parse_tool_calls
from rlbus.tool_calls import CALL_SHAPE, find_tool_calls, without_calls


def test_a_call_is_read_with_its_name_arguments_and_place():
    text = 'let me add <tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call> ok'
    (block,) = find_tool_calls(text)
    assert block.ok and block.name == "add" and block.arguments == {"a": 2}
    assert text[block.start:block.end].startswith("<tool_call>")
    assert text[block.start:block.end].endswith("</tool_call>")


def test_missing_arguments_are_none_and_a_json_string_of_them_is_read():
    no_args, as_string = find_tool_calls(
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert (no_args.name, no_args.arguments) == ("now", {})
    assert (as_string.name, as_string.arguments) == ("f", {"x": 1})


def test_each_malformed_block_says_why_it_is_no_call():
    reasons = [b.error for b in find_tool_calls(
        "<tool_call>{not json}</tool_call>"
        "<tool_call>[1]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "x", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "x", "arguments": "[1]"}</tool_call>')]
    assert reasons[0] is not None and reasons[0].startswith("tool call is not valid JSON")
    assert reasons[1:3] == [CALL_SHAPE, CALL_SHAPE]
    assert reasons[3:] == ["tool call arguments must be a JSON object"] * 2


def test_text_without_the_tags_holds_no_call():
    assert find_tool_calls('{"name": "add", "arguments": {}}') == []
    assert find_tool_calls("<tool_call> unclosed") == []


def test_only_well_formed_blocks_are_cut_out_of_the_text():
    text = 'a <tool_call>{"name": "f"}</tool_call> b <tool_call>oops</tool_call> c'
    assert without_calls(text, find_tool_calls(text)) == "a  b <tool_call>oops</tool_call> c"


def test_the_agent_takes_the_first_block_and_its_error():
    assert parse_tool_call("no call") is None
    assert parse_tool_call('<tool_call>{"name": "x", "arguments": {"k": 1}}</tool_call>'
                           '<tool_call>{"name": "y"}</tool_call>') == ("x", {"k": 1})
    assert parse_tool_call("<tool_call>[1]</tool_call>") == CALL_SHAPE


def test_the_gateway_reads_the_same_calls_in_openai_form():
    text = ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
            "<tool_call>{bad}</tool_call> done")
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>{bad}</tool_call> done"
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
