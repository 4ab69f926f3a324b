"""The official `openai` Python SDK against a live Tessera gateway.

Environment: TESSERA_BASE (http://127.0.0.1:PORT), TESSERA_KEY, TESSERA_ACCOUNT, TESSERA_MODEL_ID.
Prints one JSON object with what the SDK saw; the Rust test compares it with the ledger.
"""
import json
import os

import openai
from openai import OpenAI

base = os.environ["TESSERA_BASE"]
key = os.environ["TESSERA_KEY"]
account = os.environ["TESSERA_ACCOUNT"]
model = os.environ["TESSERA_MODEL_ID"]
msgs = [{"role": "user", "content": "What is the capital of France?"}]
out = {"version": openai.__version__}

client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
scoped = OpenAI(base_url=f"{base}/client/v4/accounts/{account}/ai/v1", api_key=key, max_retries=0)

# Non-streaming, with the raw response for the request id header.
raw = client.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=12)
c = raw.parse()
out["chat"] = {
    "request_id": raw.headers.get("x-request-id"),
    "id": c.id,
    "content": c.choices[0].message.content,
    "finish_reason": c.choices[0].finish_reason,
    "usage": c.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}),
}

# Streaming without usage.
text, ids, finish = "", set(), None
for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=12, stream=True):
    ids.add(ch.id)
    if ch.choices:
        text += ch.choices[0].delta.content or ""
        finish = ch.choices[0].finish_reason or finish
    assert ch.usage is None
out["stream"] = {"ids": sorted(ids), "content": text, "finish_reason": finish}

# Streaming with include_usage, on the account-scoped path.
text, ids, usage = "", set(), None
for ch in scoped.chat.completions.create(
    model=model, messages=msgs, max_tokens=12, stream=True, stream_options={"include_usage": True}
):
    ids.add(ch.id)
    if ch.choices:
        text += ch.choices[0].delta.content or ""
    if ch.usage is not None:
        usage = ch.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
out["stream_usage"] = {"ids": sorted(ids), "content": text, "usage": usage}

# Text completions.
comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4)
out["completion"] = {"id": comp.id, "text": comp.choices[0].text, "usage": comp.usage.model_dump(include={"prompt_tokens", "completion_tokens"})}

# Log probabilities (issue 14): chat logprobs + top_logprobs, streamed and not;
# completions logprobs + echo.
def entries(lp):
    return [
        {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
         "top": [[t.token, t.logprob] for t in e.top_logprobs]}
        for e in lp.content
    ]


lc = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=3)
streamed = []
for ch in client.chat.completions.create(
    model=model, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=3, stream=True
):
    if ch.choices and ch.choices[0].logprobs is not None:
        streamed += entries(ch.choices[0].logprobs)
out["chat_logprobs"] = {
    "content": lc.choices[0].message.content,
    "entries": entries(lc.choices[0].logprobs),
    "streamed": streamed,
}
cl = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, logprobs=2, echo=True)
out["completion_logprobs"] = {
    "text": cl.choices[0].text,
    "tokens": cl.choices[0].logprobs.tokens,
    "token_logprobs": cl.choices[0].logprobs.token_logprobs,
    "top_logprobs": cl.choices[0].logprobs.top_logprobs,
    "text_offset": cl.choices[0].logprobs.text_offset,
    "usage": cl.usage.model_dump(include={"prompt_tokens", "completion_tokens"}),
}

# Models.
out["models"] = [m.id for m in client.models.list()]

# Errors arrive as the SDK's typed exceptions.
# Structured outputs (issue 14): the SDK's own `parse` helper with a pydantic model
# (it sends a strict json_schema response_format and parses the content), and JSON mode.
from typing import Literal

from pydantic import BaseModel, Field


# Bounded fields: an unbounded string lets a small model fill max_tokens inside it.
class Pet(BaseModel):
    name: str = Field(max_length=20)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=40)


parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Describe a pet."}],
    max_tokens=80,
    response_format=Pet,
)
pet = parsed.choices[0].message.parsed
out["parsed"] = {
    "content": parsed.choices[0].message.content,
    "finish_reason": parsed.choices[0].finish_reason,
    "pet": pet.model_dump() if pet is not None else None,
    "schema": Pet.model_json_schema(),
}
jm = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=80, response_format={"type": "json_object"}
)
out["json_mode"] = {"content": jm.choices[0].message.content, "finish_reason": jm.choices[0].finish_reason}

# Tools (issue 14): a required call through the SDK's pydantic helper (strict
# function schema, arguments parsed by the SDK), a named call streamed (the SDK's
# stream helper joins the deltas), and the call's answer sent back as a `tool` message.
import openai as _openai


class GetWeather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


weather_tool = _openai.pydantic_function_tool(GetWeather, name="get_weather", description="Weather in a city")
ask = [{"role": "user", "content": "What is the weather in Lisbon?"}]
tc = client.chat.completions.parse(
    model=model, messages=ask, max_tokens=80, tools=[weather_tool], tool_choice="required"
)
call = tc.choices[0].message.tool_calls[0]
out["tool_call"] = {
    "finish_reason": tc.choices[0].finish_reason,
    "name": call.function.name,
    "arguments": json.loads(call.function.arguments),
    "parsed": call.function.parsed_arguments.model_dump() if call.function.parsed_arguments else None,
    "schema": GetWeather.model_json_schema(),
}
with client.chat.completions.stream(
    model=model,
    messages=ask,
    max_tokens=80,
    tools=[weather_tool],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
) as st:
    final = st.get_final_completion()
scall = final.choices[0].message.tool_calls[0]
out["tool_call_stream"] = {
    "finish_reason": final.choices[0].finish_reason,
    "name": scall.function.name,
    "arguments": json.loads(scall.function.arguments),
}
answer = client.chat.completions.create(
    model=model,
    max_tokens=30,
    tools=[weather_tool],
    messages=ask
    + [
        tc.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ],
)
out["tool_answer"] = {"finish_reason": answer.choices[0].finish_reason}

errors = {}
try:
    client.chat.completions.create(model=model, messages=msgs, max_tokens=100000)
except openai.BadRequestError as e:
    errors["context"] = {"status": e.status_code, "code": e.code, "message": e.message}
try:
    OpenAI(base_url=base + "/v1", api_key="tsk_bad", max_retries=0).models.list()
except openai.AuthenticationError as e:
    errors["auth"] = {"status": e.status_code, "code": e.code}
try:
    client.chat.completions.create(model="no-such-model", messages=msgs)
except openai.NotFoundError as e:
    errors["model"] = {"status": e.status_code, "code": e.code}
try:
    client.chat.completions.create(model=model, messages=msgs, logprobs=True, top_logprobs=21)
except openai.BadRequestError as e:
    errors["top_logprobs"] = {"status": e.status_code, "param": e.param}
try:
    client.completions.create(model=model, prompt="a", n=2)
except openai.BadRequestError as e:
    errors["n"] = {"status": e.status_code, "param": e.param}
try:
    client.chat.completions.create(
        model=model, messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    )
except openai.BadRequestError as e:
    errors["response_format"] = {"status": e.status_code, "param": e.param}
try:
    client.chat.completions.create(model=model, messages=msgs, tools=[weather_tool], tool_choice="sometimes")
except openai.BadRequestError as e:
    errors["tool_choice"] = {"status": e.status_code, "param": e.param}
out["errors"] = errors
print(json.dumps(out))
