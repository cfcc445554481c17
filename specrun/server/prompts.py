"""Prompt tokens for a request, what the KV cache already holds of them, and how much room is left."""

from __future__ import annotations

from specrun.server.schemas import APIError


class ConversationMemory:
    """The text and tokens of the last chat (prompt + answer), so its next turn tokenizes only the new part.

    Re-tokenizing the whole conversation could split the earlier answer into other tokens than the
    model generated, and the cache would then be reused only up to that point. As in `specrun
    chat`, a rendered conversation that starts with the remembered text reuses its tokens.
    """

    def __init__(self) -> None:
        self.text: str | None = None
        self.tokens: list[int] = []

    def tokens_for(self, fmt, rendered) -> list[int]:
        """Return the tokens of `rendered` (a chat.control.Marked), reusing the remembered ones."""
        text, start = rendered.text, len(self.text or "")
        if (self.text and len(text) > start and text.startswith(self.text)
                and not any(s < start < e for s, e, _ in rendered.specials)):
            return self.tokens + fmt.tokenize_more(rendered, start)
        return fmt.tokenize_start(rendered)

    def remember(self, text: str, tokens: list[int]) -> None:
        self.text, self.tokens = text, list(tokens)

    def forget(self) -> None:
        self.text, self.tokens = None, []



def token_budget(n_prompt: int, n_ctx: int, requested: int | None, param: str) -> int:
    """Return how many tokens may be generated: the request's limit, capped by the room in the context."""
    room = n_ctx - n_prompt
    if room < 2:
        raise APIError(
            400, f"the prompt has {n_prompt} tokens but the context holds {n_ctx}: shorten it "
            "(or restart the server with a larger --ctx-size)", param=param, code="context_length_exceeded",
        )
    # One token of room stays free: the last generated token is never decoded into the cache.
    return room - 1 if requested is None else min(requested, room - 1)
