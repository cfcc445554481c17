"""Turning command-line choices into loaded models, contexts and a decoder.

`Runtime` resolves the target (and draft) names through the registry, fetches missing files,
checks that the pair shares a vocabulary before any context is created, loads both models, picks
the tree settings (explicit flags, else the stored tuning profile, else safe defaults) and builds
the decoder. Commands use it as a context manager so everything is freed in the right order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from specrun.errors import UsageError

log = logging.getLogger("specrun")

DEFAULT_CTX = 4096
# Used when no tuning profile exists: a short chain (classic speculative decoding), which pays
# wherever the draft is much cheaper than the target, even on a CPU where wide trees cost dearly.
DEFAULT_SHAPE = dict(budget=5, depth=5, width=1, top_k=1)
PREFILL_BATCH = 512


@dataclass(frozen=True)
class RunOptions:
    """Options shared by chat, generate, bench and tune."""

    target: str | None = None
    draft: str | None = None
    gpu_layers: int | None = None
    ctx_size: int = DEFAULT_CTX
    threads: int | None = None
    budget: int | None = None
    depth: int | None = None
    no_spec: bool = False
    quiet: bool = False  # no download progress bars


@dataclass
class ResolvedModels:
    target_name: str
    target_path: Path
    draft_name: str | None
    draft_path: Path | None


def resolve_models(opts: RunOptions) -> ResolvedModels:
    """Return local paths for the target and draft, fetching what is missing (after saying what)."""
    from specrun import registry

    if opts.target is None:
        target_name, default_draft = registry.default_pair()
    else:
        target_name, default_draft = opts.target, None
    target_spec = registry.resolve(target_name)
    draft_spec = None
    if not opts.no_spec:
        if opts.draft is not None:
            draft_spec = registry.resolve(opts.draft)
        elif default_draft is not None and opts.target is None:
            draft_spec = registry.resolve(default_draft)
        else:
            draft_spec = registry.recommended_draft(target_spec)
        if draft_spec is not None:
            registry.check_pair(target_spec, draft_spec)
    target_path = _ensure_local(target_spec, opts.quiet)
    draft_path = _ensure_local(draft_spec, opts.quiet) if draft_spec is not None else None
    return ResolvedModels(
        target_spec.name, Path(target_path), draft_spec.name if draft_spec else None, Path(draft_path) if draft_path else None
    )


def _ensure_local(spec, quiet: bool) -> Path:
    """Return the model's local path; a missing model is announced (what, how big) and fetched."""
    from specrun import hub, ui

    missing = hub.describe_missing(spec)
    if missing and not quiet:
        ui.info(f"pulling {missing}...")
    return hub.ensure_local(spec, progress=not quiet, console=ui.err_console())


class Runtime:
    """Loaded target (and draft) models with their contexts, and the decoder to use."""

    def __init__(self, opts: RunOptions, shape_override=None):
        from specrun import engine, pairing
        from specrun.draft import TreeShape

        self.opts = opts
        self.models = resolve_models(opts)
        self._owned: list = []
        self._untuned = False  # speculating with the default tree: no tuning profile for the pair
        self._chat_format = None
        try:
            from specrun import placement

            target_layers, draft_layers = placement.gpu_layers(
                self.models.target_path, self.models.draft_path, opts.ctx_size,
                (opts.budget or DEFAULT_SHAPE["budget"]) + 1, override=opts.gpu_layers,
            )
            self.target = self._load(self.models.target_path, target_layers)
            self.draft = None
            self.shape: TreeShape | None = None
            self.template = None  # a tuned Sequoia tree, grown as is
            if self.models.draft_path is not None:
                if shape_override is not None:
                    self.shape = shape_override
                else:
                    self.shape, self.template = self._choose_shape()
            if self.shape is not None:
                self.draft = self._load(self.models.draft_path, draft_layers)
                pairing.check_vocab(self.target, self.draft, self.models.target_name, self.models.draft_name)
            spec = self.shape is not None
            n_batch = max(PREFILL_BATCH, self.shape.budget + 1) if spec else PREFILL_BATCH
            self.target_ctx = engine.Context(
                self.target, n_ctx=opts.ctx_size, n_batch=n_batch, n_seq_max=engine.MAX_SEQ if spec else 1, threads=opts.threads
            )
            self._owned.append(self.target_ctx)
            self.draft_ctx = None
            if spec:
                self.draft_ctx = engine.Context(
                    self.draft, n_ctx=opts.ctx_size, n_batch=PREFILL_BATCH, n_seq_max=engine.MAX_SEQ, threads=opts.threads
                )
                self._owned.append(self.draft_ctx)
        except BaseException:
            self.close()
            raise
        self.decoder = self._make_decoder()
        if self._untuned and not opts.quiet:
            self._suggest_tuning()

    def _suggest_tuning(self) -> None:
        """Once per pair that runs without a profile (and loaded fine): say that tuning exists."""
        from specrun import profiles, ui

        if profiles.first_suggestion(self.models.target_path, self.models.draft_path):
            ui.dim("tip: `specrun tune` measures this machine once and picks the fastest tree for this pair")

    def _load(self, path: Path, gpu_layers: int):
        from specrun import engine

        model = engine.Model(path, n_gpu_layers=gpu_layers)
        self._owned.append(model)
        return model

    def _choose_shape(self):
        """Return (tree shape or None for plain decoding, Sequoia template or None).

        Explicit --budget/--depth win; else the stored tuning profile (which may say plain
        decoding is faster here); else a safe default.
        """
        from specrun import profiles
        from specrun.draft import TreeShape

        opts = self.opts
        choice = profiles.choice_for(self.models.target_path, self.models.draft_path, opts.threads)
        overridden = opts.budget is not None or opts.depth is not None
        if choice is not None and choice.kind == "plain" and not overridden:
            log.info("tuning profile: plain decoding is fastest for this pair on this machine")
            return None, None
        tuned = profiles.shape_of(choice) if choice is not None else None
        template = choice.tree if tuned is not None and choice.kind == "sequoia" else None
        if tuned is not None:
            shape = tuned
            kind = "Sequoia static tree" if template is not None else "SpecExec tree"
            log.info("tuning profile: %s of %d draft tokens, depth %d", kind, shape.budget, shape.depth)
        else:
            shape = TreeShape(**DEFAULT_SHAPE)
            if choice is None:
                log.info("no tuning profile for this pair; using a chain of %d draft tokens", shape.budget)
                self._untuned = True
        if overridden:
            template = None  # explicit sizes: grow best-first trees of that size
            if opts.budget is not None:
                shape = shape.resized(opts.budget)
            if opts.depth is not None:
                shape = replace(shape, depth=opts.depth)
        return shape, template

    def _make_decoder(self):
        from specrun.generate import PlainDecoder
        from specrun.speculative import SpeculativeDecoder

        if self.shape is None:
            return PlainDecoder(self.target, self.target_ctx)
        grower = None
        if self.template is not None:
            from specrun.sequoia_draft import StaticTreeGrower

            grower = StaticTreeGrower(self.draft, self.draft_ctx, self.template)
        return SpeculativeDecoder(self.target, self.target_ctx, self.draft, self.draft_ctx, self.shape, grower=grower)

    @property
    def speculative(self) -> bool:
        return self.shape is not None

    def plain_decoder(self):
        """Return a plain decoder on the target context (shares its KV cache with the main decoder)."""
        from specrun.generate import PlainDecoder

        return PlainDecoder(self.target, self.target_ctx)

    @property
    def chat_format(self):
        """Return the target's chat format (template, special tokens), made on first use."""
        if self._chat_format is None:
            from specrun.chat import ChatFormat

            self._chat_format = ChatFormat(self.target)
        return self._chat_format

    def tokenize_prompt(self, text: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        """Return the prompt's tokens, wrapped in the chat template in chat mode.

        chat=None means: chat mode when the model has a chat template (an instruct model), raw
        text otherwise. A chat message loses surrounding whitespace (the newline `echo` adds);
        raw text is kept exactly as given.
        """
        if chat is None:
            chat = self.chat_format.has_template
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text.strip()}]
            fmt = self.chat_format
            return fmt.tokenize_start(fmt.render(messages, add_generation_prompt=True))
        if system:
            raise UsageError("--system needs chat mode (drop --raw)")
        return self.target.tokenize(text, add_special=True, parse_special=False)

    def reset_cache(self) -> None:
        """Empty both KV caches (after an interrupted step left them in an unknown state)."""
        decoder = self.decoder
        decoder.ctx.clear()
        decoder.cache.tokens.clear()
        grower = getattr(decoder, "grower", None)
        if grower is not None:
            grower.reset()

    def close(self) -> None:
        for owner in reversed(self._owned):
            owner.close()
        self._owned.clear()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
