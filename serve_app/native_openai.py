"""OpenAI requests in, OpenAI responses out, for the native engine.

The request and response types are vLLM's OpenAI protocol models as Ray Serve LLM
re-exports them (the same objects the vLLM replica answers with), so the ingress treats
both engines alike: a non-streaming call yields one `CompletionResponse` /
`ChatCompletionResponse`, a streaming call yields server-sent-event strings
(`data: {chunk}\\n\\n`, then `data: [DONE]\\n\\n`), and a bad request yields one
`ErrorResponse` whose code becomes the HTTP status.

Chat prompts are rendered with the model's own chat template (transformers), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.ray_llm import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
)
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice, CompletionResponseStreamChoice
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from native_engine.requests import SamplingParams


class BadRequest(ValueError):
    """A request the engine cannot serve; becomes an HTTP 400 with this message."""


def error_response(message: str, code: int = 400, type: str = "BadRequestError") -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, code=code))


# ----------------------------------------------------------------------------------- requests
def _check_supported(request: CompletionRequest | ChatCompletionRequest) -> None:
    if (request.n or 1) != 1:
        raise BadRequest("n: engine native returns one choice per request; use n=1")
    if request.logprobs:
        raise BadRequest("logprobs: not supported by engine native")
    if getattr(request, "use_beam_search", False):
        raise BadRequest("use_beam_search: not supported by engine native")


def completion_prompt(request: CompletionRequest, tokenizer) -> list[int]:
    """Token ids of the one prompt of a /v1/completions request (text or token ids)."""
    _check_supported(request)
    if request.echo or request.suffix:
        raise BadRequest("echo and suffix: not supported by engine native")
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt: engine native takes one prompt per request (a string or a list of token ids)")
    if not ids:
        raise BadRequest("prompt: must not be empty")
    return ids


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise BadRequest(f"messages: content of type {part.get('type')!r} is not supported (text only)")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt(request: ChatCompletionRequest, tokenizer) -> list[int]:
    """Token ids of a chat, rendered with the model's chat template (generation prompt added)."""
    _check_supported(request)
    if request.tools:
        raise BadRequest("tools: not supported by engine native")
    if not request.messages:
        raise BadRequest("messages: must not be empty")
    messages = [{"role": m["role"], "content": _message_text(m.get("content"))} for m in request.messages]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message)
    return tokenizer.encode(text, add_special_tokens=False)


def sampling_params(request: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                    max_model_len: int) -> SamplingParams:
    """The engine's SamplingParams; raises BadRequest for values the engine cannot run."""
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if prompt_len >= max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                         f"{prompt_len} tokens. Please reduce the length of the prompt.")
    if max_tokens is None:  # chat without a limit: the rest of the context window
        max_tokens = max_model_len - prompt_len
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.")
    if prompt_len + max_tokens > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{max_tokens} output tokens and your prompt contains {prompt_len} input tokens, for a "
                         f"total of {prompt_len + max_tokens} tokens. Please reduce the length of the prompt "
                         f"or max_tokens.")
    stop = request.stop or ()
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,  # OpenAI's default
            top_p=1.0 if request.top_p is None else request.top_p,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            seed=request.seed,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None


# ----------------------------------------------------------------------------------- text
class IncrementalText:
    """The part of a request's output text that is safe to send now.

    The engine reports the whole text so far at every step. Held back until a later step:
    a trailing U+FFFD (a multi-byte UTF-8 character whose last bytes are still to come),
    and, with stop strings, the last len(longest stop) - 1 characters (a stop string may be
    forming there, and the engine cuts it from the text once complete)."""

    def __init__(self, stop: tuple[str, ...]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0  # characters of the text already sent

    def delta(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            end = max(self.sent, end - self.holdback)
        out = text[self.sent: end]
        self.sent = max(self.sent, end)
        return out


# ----------------------------------------------------------------------------------- responses
@dataclass
class Result:
    """One request's outcome, for the usage block and the final choice."""

    request_id: str
    model: str
    created: int
    prompt_tokens: int
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)


def sse(chunk) -> str:
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def completion_response(r: Result) -> CompletionResponse:
    choice = CompletionResponseChoice(index=0, text=r.text, finish_reason=r.finish_reason)
    return CompletionResponse(id=r.request_id, created=r.created, model=r.model, choices=[choice], usage=r.usage)


def completion_chunk(r: Result, text: str, finish_reason: str | None = None) -> CompletionStreamResponse:
    choice = CompletionResponseStreamChoice(index=0, text=text, finish_reason=finish_reason)
    return CompletionStreamResponse(id=r.request_id, created=r.created, model=r.model, choices=[choice])


def chat_response(r: Result) -> ChatCompletionResponse:
    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=r.text),
                                          finish_reason=r.finish_reason)
    return ChatCompletionResponse(id=r.request_id, created=r.created, model=r.model, choices=[choice], usage=r.usage)


def chat_chunk(r: Result, delta: DeltaMessage, finish_reason: str | None = None) -> ChatCompletionStreamResponse:
    choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish_reason)
    return ChatCompletionStreamResponse(id=r.request_id, created=r.created, model=r.model, choices=[choice])


def usage_chunk(r: Result, chat: bool):
    cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
    return cls(id=r.request_id, created=r.created, model=r.model, choices=[], usage=r.usage)
