"""One generation request (sampling settings and limits) and running it on a loaded Runtime."""

from __future__ import annotations

from dataclasses import dataclass

from specrun.core.sampling import SamplingParams
from specrun.decoding.stream import Result, stream


@dataclass(frozen=True)
class Request:
    """One generation request: sampling settings and limits."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool | None = None  # None: chat mode when the model has a chat template
    system: str | None = None
    parse_special: bool = True  # raw prompts: special-token text becomes special tokens (chat messages: never)

    def sampling(self):
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)


def run_request(rt, request: Request, text: str, on_text=None):
    """Generate for one prompt text; call on_text(chunk) as text streams; return the Result."""
    prompt = rt.tokenize_prompt(text, request.chat, request.system, request.parse_special)
    decoder = rt.decoder
    parts: list[str] = []
    tokens: list[int] = []
    for chunk in stream(decoder, rt.target, prompt, request.sampling(), request.max_tokens, request.stop):
        if on_text is not None:
            on_text(chunk.text)
        parts.append(chunk.text)
        tokens.extend(chunk.tokens)
    return Result("".join(parts), tokens, decoder.stats)
