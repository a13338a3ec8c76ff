"""`smartgen generate`: sends one prompt to a decode node, streams the answer, then prints its TTFT, TTST and TBT.

The answer goes to stdout as it arrives; the timing line goes to stderr, so `smartgen generate ... > answer.txt`
keeps only the answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import typer

from .errors import fail

__all__ = ["GenerateError", "stream_generate", "generate"]

_TIMEOUT = httpx.Timeout(10.0, read=600.0)  # a long prompt's prefill (and a slow link) may keep the first token away


class GenerateError(RuntimeError):
    """The decode node could not be reached, refused the request, or failed while generating."""


def stream_generate(
    url: str,
    prompt: str,
    *,
    max_tokens: int = 64,
    temperature: float = 0.0,
    scheme: str | None = None,
    chat: bool = False,
) -> Iterator[str | dict[str, Any]]:
    """Streams one request from the decode node at `url`: yields text pieces as they arrive, the usage block last."""
    base = url.rstrip("/").removesuffix("/v1")
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if scheme:
        body["scheme"] = scheme
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    try:
        with httpx.stream("POST", base + path, json=body, timeout=_TIMEOUT) as response:
            if response.status_code >= 400:
                response.read()
                raise GenerateError(f"the decode node answered HTTP {response.status_code}: {_message(response.text)}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise GenerateError(f"generation failed: {event['error'].get('message', event['error'])}")
                for choice in event.get("choices", []):
                    text = choice["delta"].get("content") if chat else choice.get("text")
                    if text:
                        yield text
                if event.get("usage"):
                    yield event["usage"]
    except httpx.TransportError as exc:
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            raise GenerateError(f"cannot reach the decode node at {url}: {exc}") from exc
        raise GenerateError(f"lost the connection to the decode node at {url}: {exc}") from exc


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt to complete (with --chat: the user's message).")],
    url: Annotated[
        str, typer.Option("--url", help="Base URL of the decode node's HTTP API.", rich_help_panel="Server")
    ] = "http://127.0.0.1:8000",
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Most tokens to generate.", rich_help_panel="Sampling")
    ] = 64,
    temperature: Annotated[
        float,
        typer.Option("--temperature", min=0.0, help="Sampling temperature; 0 is greedy.", rich_help_panel="Sampling"),
    ] = 0.0,
    scheme: Annotated[
        str | None,
        typer.Option(
            "--scheme",
            help="KV transfer scheme for this request (default: the decode node's --scheme).",
            rich_help_panel="Transfer",
        ),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="Send the prompt as a chat message (uses the model's chat template).",
            rich_help_panel="Sampling",
        ),
    ] = False,
) -> None:
    """Stream one answer from a decode node, then print TTFT, TTST and mean TBT (on stderr)."""
    usage: dict[str, Any] = {}
    printed = False
    try:
        for item in stream_generate(
            url, prompt, max_tokens=max_tokens, temperature=temperature, scheme=scheme, chat=chat
        ):
            if isinstance(item, dict):
                usage = item
            else:
                typer.echo(item, nl=False)
                printed = True
    except GenerateError as exc:
        if printed:  # end the partial answer's line before the error
            typer.echo("")
        fail(str(exc), code=1)
    typer.echo("")
    typer.echo(timing_line(usage), err=True)


def timing_line(usage: dict[str, Any]) -> str:
    """`TTFT 12.3 ms  TTST 45.6 ms  mean TBT 7.8 ms  (20 tokens, scheme smartgen)` from a usage block."""

    def ms(key: str) -> str:
        value = usage.get(key)
        return "n/a" if value is None else f"{value * 1000:.1f} ms"

    tokens, scheme = usage.get("completion_tokens", "?"), usage.get("scheme") or "default"
    return f"TTFT {ms('ttft')}  TTST {ms('ttst')}  mean TBT {ms('tbt')}  ({tokens} tokens, scheme {scheme})"


def _message(body: str) -> str:
    try:
        error = json.loads(body)["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return body.strip()[:500] or "(no message)"
