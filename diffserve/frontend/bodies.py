"""Reading request bodies: JSON parsed whatever the content type, validated by pydantic, each
complaint phrased as the OpenAI error naming the offending parameter; and waiting on work while
watching whether the client is still there."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from diffserve.errors import APIError, invalid_request
from diffserve.frontend.uploads import read_limited


def param_name(loc) -> str:
    """A parameter's name as the OpenAI API writes it: ``controls[0].scale``."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic complaint, phrased with the offending parameter."""
    first = errors[0] if errors else {}
    param = param_name([p for p in first.get("loc", ()) if p != "body"]) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return invalid_request("We could not parse the JSON body of your request. The body must "
                               "be a JSON object.", None, "invalid_json")
    if kind == "extra_forbidden":
        return invalid_request(f"Unknown parameter: {param!r}.", param, "unknown_parameter")
    if kind == "missing":
        return invalid_request(f"Missing required parameter: {param!r}.", param,
                               "missing_required_parameter")
    if kind == "model_attributes_type" or not param:
        return invalid_request("The request body must be a JSON object.", None, "invalid_type")
    if kind in ("literal_error", "enum"):  # a value outside a set: name the value given
        given = repr(first.get("input"))
        given = given if len(given) <= 64 else given[:61] + "..."
        return invalid_request(f"Invalid value {given} for {param!r}: {first.get('msg')}.", param,
                               "invalid_value")
    return invalid_request(f"Invalid value for {param!r}: {first.get('msg', 'invalid')}.", param,
                           "invalid_value")


def validate(model: type[BaseModel], data) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


async def parse_json(request: Request, model: type[BaseModel], limit: int, flag: str) -> BaseModel:
    """The body as ``model``, whatever its content type (``curl -d`` sends form encoding); 413
    naming ``flag`` past ``limit`` bytes."""
    raw = await read_limited(request.stream(), limit, request.headers.get("content-length"), flag)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise validation_error([{"type": "json_invalid"}]) from None
    return validate(model, data)


def json_body_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


def form_body_schema(model: type[BaseModel], json_model: type[BaseModel] | None = None) -> dict:
    """A multipart body's schema (the files beside ``model``'s fields), and ``json_model`` as
    the JSON body the route also takes."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema["properties"] = {"image": {"type": "string", "format": "binary"},
                            "mask": {"type": "string", "format": "binary"}, **schema["properties"]}
    schema["required"] = ["image", *schema.get("required", [])]
    content = {"multipart/form-data": {"schema": schema}}
    if json_model is not None:
        content.update(json_body_schema(json_model)["requestBody"]["content"])
    return {"requestBody": {"required": True, "content": content}}


async def until_disconnected(request: Request, work):
    """Await ``work``, unless the client disconnects first: then cancel it and return None.
    If the caller itself is cancelled, ``work`` is cancelled with it.

    After the body is read, the ASGI ``receive`` only returns on disconnect, so waiting on it is
    an event, not a poll."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled ourselves: so is the work, without waiting for it
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
