"""OpenAI's Responses API (`POST /v1/responses`) over the chat path. A request becomes a chat: its
instructions the system message, its input items messages (function calls an assistant's tool calls,
their outputs tool messages), after the conversation of `previous_response_id`. The answer becomes
output items, a message and function calls, whole or as the Responses stream's events. Stored
responses (`store`, OpenAI's default) stay in the server's memory, bounded, for `previous_response_id`."""

import collections
import copy
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from kiln.runtime.engine import RequestOutput
from kiln.server import reasoning
from kiln.server.errors import ServerError, stream_error
from kiln.server.protocol import (CALLS_NEED_TOOLS, ChatCompletionRequest, NonEmptyText, Strict, integer, to_json,
                                  validation_message)
from kiln.server.serving import Server, finals, merged, off_loop


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = Field(None, description="an earlier answer's, sent back: not read")
    logprobs: list | None = Field(None, description="an earlier answer's, sent back: not read")


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_kind(item) -> str:
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")] |
                      Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = Field(None, description="calls held to `parameters` by a grammar, as in chat")


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(Strict):
    format: TextFormat | None = None


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="given to the chat template as `reasoning_effort`, as in chat")


class ResponsesRequest(Strict):
    """The fields kiln honours; any other is refused by name, as everywhere."""

    model_config = ConfigDict(json_schema_extra=CALLS_NEED_TOOLS)

    model: str
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="the system message; not carried to the next response")
    previous_response_id: str | None = Field(None, description="a stored response whose conversation comes first")
    store: bool = Field(True, description="keep this response (in memory, bounded) for previous_response_id")
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: integer(ge=1) | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled"] | None = Field(None, description="kiln never drops context: a conversation "
                                                   "past the model's context is a 400")
    include: list[str] | None = Field(None, json_schema_extra={"maxItems": 0},
                                      description="must be empty: kiln adds nothing to the output items")
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="returned with the response")
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="no effect: one tier here")

    @field_validator("input", mode="before")
    @classmethod
    def _not_empty(cls, value):
        if value in ("", []):
            raise ValueError("the input is empty: give text or at least one item")
        return value

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, value):
        if value:
            raise ValueError(f"kiln adds nothing to the output items ({', '.join(value)}: no logprobs, reasoning or "
                             "search results here): leave include empty")
        return value


class ResponseStore:
    """Stored responses, each its response object and its conversation (chat messages, the answer last),
    newest kept: at most `count` of them and `characters` of their JSON together."""

    def __init__(self, count: int, characters: int = 64 * 2**20):
        self.count, self.characters = count, characters
        self._items: collections.OrderedDict[str, tuple[list[dict], dict, int]] = collections.OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        size = len(json.dumps(messages)) + len(json.dumps(response))
        with self._lock:
            self._items[response_id] = (messages, response, size)
            self._size += size
            while self._items and (len(self._items) > self.count or self._size > self.characters):
                _, (_, _, dropped) = self._items.popitem(last=False)
                self._size -= dropped

    def _find(self, response_id: str, param: str | None) -> tuple[list[dict], dict, int]:
        with self._lock:
            found = self._items.get(response_id)
        if found is None:
            raise ServerError(404, f"no stored response `{response_id}`: it was sent with store false, deleted, or "
                                   f"this server has dropped it (it keeps the newest {self.count}, "
                                   "--max-stored-responses)", param=param)
        return found

    def get(self, response_id: str) -> list[dict]:
        """The conversation that `previous_response_id` continues."""
        return self._find(response_id, "previous_response_id")[0]

    def response(self, response_id: str) -> dict:
        """The response object, as it was sent (GET /v1/responses/{id})."""
        return self._find(response_id, None)[1]

    def delete(self, response_id: str) -> None:
        self._find(response_id, None)
        with self._lock:
            found = self._items.pop(response_id, None)
            if found is not None:
                self._size -= found[2]


def chat_of(body: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat the request asks for, and its conversation without the instructions (what is stored)."""
    conversation = copy.deepcopy(store.get(body.previous_response_id)) if body.previous_response_id else []
    items = [body.input] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, str):
            conversation.append({"role": "user", "content": item})
        elif isinstance(item, MessageItem):
            conversation.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = conversation[-1] if conversation else None
            if last is not None and last["role"] == "assistant":  # the text before it, or an earlier call
                last.setdefault("tool_calls", []).append(call)
            else:
                conversation.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            conversation.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict = {"model": body.model, "messages": system + conversation, "temperature": body.temperature,
                  "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
                  "max_completion_tokens": body.max_output_tokens, "user": body.user}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_ or {}, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), conversation
    except ValidationError as e:  # what the chat checks beyond the fields themselves: tool_choice against tools
        message, param = validation_message(e, ChatCompletionRequest)
        raise ServerError(400, message, param=param) from None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: dict) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


class Responder:
    """One request's response object, whole or as events."""

    def __init__(self, server: Server, body: ResponsesRequest, chat: ChatCompletionRequest, prompt_tokens: int):
        self.server, self.body, self.chat, self.prompt_tokens = server, body, chat, prompt_tokens
        self.id, self.created = _id("resp"), int(time.time())
        self.tools = bool(chat.tools) and chat.tool_mode != "none"

    def response(self, output: list[dict], status: str, out: RequestOutput | None) -> dict:
        body = self.body
        generated = len(out.token_ids) if out is not None else 0
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.server.model_name, "output": output, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice)
            else body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "truncation": "disabled",
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "user": body.user, "service_tier": body.service_tier or "default",
            "usage": None if out is None else {
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + generated}}

    def split(self, text: str) -> tuple[str, list[dict]]:
        """The answer's text (after any thinking) and its calls in chat's shape (the tool-call format's)."""
        text = self.thinking(text)[1]
        if not self.tools:
            return text, []
        content, calls = self.server.tool_format.parse(text, self.chat.tools)
        return content or "", calls

    def thinking(self, text: str, finished: bool = True) -> tuple[str, str]:
        """(reasoning, answer) where the server has a reasoning parser, else ("", text)."""
        parser = self.server.config.reasoning_parser
        return ("", text) if parser is None else reasoning.split(text, parser, finished)

    def whole(self, out: RequestOutput) -> dict:
        content, calls = self.split(out.text)
        thought = self.thinking(out.text)[0]
        output = ([_reasoning(thought)] if thought else []) + \
            ([_message(_id("msg"), content)] if content or not calls else []) + [_function_call(c) for c in calls]
        return self.response(output, _status(out), out)


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def _answer(content: str, calls: list[dict]) -> dict:
    """The answer as a chat message, stored for the next response in the conversation."""
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


async def respond(server: Server, store: ResponseStore, body: ResponsesRequest, request: Request) -> Response:
    """/v1/responses: the conversation's next answer, whole or as events."""
    server.check_model(body.model)
    server.engine.admit(1)
    chat, conversation = await off_loop(chat_of, body, store)
    chat = server.with_tool_marker(chat)
    server.check_limits(chat)
    prompt = await off_loop(server.chat_prompt, chat)
    structured = await off_loop(server.constraint, chat)
    streams = await server.start([prompt], chat, chat.max_completion_tokens, None, structured)
    responder = Responder(server, body, chat, len(prompt[0]))

    def keep(out: RequestOutput, response: dict) -> None:
        if body.store:
            content, calls = responder.split(out.text)
            store.put(responder.id, conversation + [_answer(content, calls)], response)

    if body.stream:
        return StreamingResponse(_events(responder, streams, keep), media_type="text/event-stream")
    done = await finals(streams, request)
    if done is None:
        return Response(status_code=499)  # nobody reads it: nginx's status for a client that left
    response = responder.whole(done[0])
    keep(done[0], response)
    return Response(to_json(response), media_type="application/json")


async def _events(responder: Responder, streams, keep) -> AsyncIterator[str]:
    """The Responses stream: created, in_progress, each output item added, its text deltas (a call whole,
    once its block closes), done, then completed (or incomplete); an error event if it fails."""
    number = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": next(number), **fields}
        return f"event: {kind}\ndata: {to_json(payload).decode()}\n\n"

    output: list[dict] = []
    message: dict | None = None  # the message item being written
    text = ""
    parser = responder.server.tool_format.parser(responder.chat.tools) if responder.tools else None
    sent, thought_sent = 0, False
    yield event("response.created", response=responder.response([], "in_progress", None))
    yield event("response.in_progress", response=responder.response([], "in_progress", None))
    try:
        async for _, out in merged(streams):
            thought, answer = responder.thinking(out.text, out.finished)
            if thought and not thought_sent and (answer or out.finished):  # the thinking, whole, once it ends
                thought_sent = True
                output.append(_reasoning(thought))
                yield event("response.output_item.added", output_index=len(output) - 1, item=output[-1])
                yield event("response.output_item.done", output_index=len(output) - 1, item=output[-1])
            if parser is not None:
                found = parser.delta(answer, out.finished)
                delta, calls = found.get("content", ""), found.get("tool_calls", [])
            else:
                delta, calls, sent = answer[sent:], [], max(sent, len(answer))
            if delta:
                if message is None:
                    message, text = _message(_id("msg"), "", "in_progress"), ""
                    yield event("response.output_item.added", output_index=len(output), item=message)
                    yield event("response.content_part.added", item_id=message["id"], output_index=len(output),
                                content_index=0, part=_text_part(""))
                text += delta
                yield event("response.output_text.delta", item_id=message["id"], output_index=len(output),
                            content_index=0, delta=delta, logprobs=[])
            if message is not None and (calls or out.finished):
                for kind, extra in (("response.output_text.done", {"text": text, "logprobs": []}),
                                    ("response.content_part.done", {"part": _text_part(text)})):
                    yield event(kind, item_id=message["id"], output_index=len(output), content_index=0, **extra)
                output.append(_message(message["id"], text))
                yield event("response.output_item.done", output_index=len(output) - 1, item=output[-1])
                message = None
            for call in calls:
                item = _function_call({k: v for k, v in call.items() if k != "index"})
                index = len(output)
                yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                    "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                output.append(item)
                yield event("response.output_item.done", output_index=index, item=item)
            if out.finished:
                if not output:  # an empty answer is still a message
                    output.append(_message(_id("msg"), ""))
                    yield event("response.output_item.added", output_index=0, item=output[0])
                    yield event("response.output_item.done", output_index=0, item=output[0])
                status = _status(out)
                response = responder.response(output, status, out)
                keep(out, response)
                yield event(f"response.{status}", response=response)
    except Exception as e:  # noqa: BLE001 - the client gets an error event, not a cut stream
        error = stream_error(e)["error"]
        yield event("error", code=str(error["code"]), message=error["message"], param=error["param"])
