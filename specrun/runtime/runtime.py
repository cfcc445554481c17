"""Loading a plan: the models, their contexts and the decoder, freed in the right order.

`Runtime(plan)` loads exactly what `plan.build_plan` decided (files, GPU layers, context sizes,
tree) and builds the decoder; it decides nothing itself. `Runtime(opts)` builds the plan first.
Commands use it as a context manager so contexts are closed before their models.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from specrun import engine, ui
from specrun.chat.session import ChatFormat
from specrun.decoding.batching import Lane, PassGate
from specrun.decoding.kv import chains_exact, probe_context
from specrun.decoding.memory import OutputMemory, memory_note, memory_path
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.pay import rules
from specrun.decoding.pay.guard import SpeedGuard
from specrun.decoding.pay.together import Together
from specrun.files import human_size
from specrun.hardware import offload
from specrun.models import pairing, registry
from specrun.runtime.plan import ContextPlan, Plan, RunOptions, build_plan
from specrun.runtime.trees import TreePlan
from specrun.tuning import attention, profiles

log = logging.getLogger("specrun")


# How far what llama.cpp allocated may be from the plan's figures before the run says so: the
# plan takes them from llama.cpp's own simulation of the same load, so a larger gap is a bug.
ALLOCATION_DRIFT = 0.05


def check_allocation(plan: Plan, allocated: engine.Allocation) -> None:
    """Say (--verbose) what llama.cpp allocated against the plan; warn where they part by more
    than ALLOCATION_DRIFT (only for plans whose figures are llama.cpp's own). The KV cache and
    recurrent state are the same wherever they live; buffers and the total are compared where
    everything is in RAM (each GPU backend sizes its compute buffers its own way, and a GPU given
    with --gpu is not one llama.cpp loads onto)."""
    planned = plan.placement.breakdown
    if not plan.placement.measured or not planned:
        return
    planned_total = sum(p.total for p in planned)
    log.info("memory: llama.cpp allocated %s (weights %s%s, context %s, compute %s, output %s); planned %s",
             human_size(allocated.total), human_size(allocated.weights),
             f" and {human_size(allocated.repacked)} of them repacked for the CPU" if allocated.repacked else "",
             human_size(allocated.context), human_size(allocated.compute_total), human_size(allocated.output),
             human_size(planned_total))
    compared = [("the KV cache and recurrent state", sum(p.context for p in planned), allocated.context)]
    if not plan.devices:
        compared.append(("compute and output buffers", sum(p.compute + p.output for p in planned),
                         allocated.compute_total + allocated.output))
        compared.append(("everything", planned_total, allocated.total - allocated.repacked))
    for what, planned_bytes, actual in compared:
        if actual and abs(planned_bytes - actual) > ALLOCATION_DRIFT * actual:
            ui.warn(f"llama.cpp allocated {human_size(actual)} for {what} where the plan counted "
                    f"{human_size(planned_bytes)}: the memory plan is off (please report it)")


def options_as_loaded(opts: RunOptions) -> RunOptions:
    """`opts` as the Runtime loads them (and `serve` fetches them): a reproducible run where no
    greedy chain may verify exactly decodes one token a pass (SamplingParams.reproducible), so it
    asks for no draft model, lookup or MTP layers; a draft named by mistake is still an error, as
    where it would load. (Where a chain may, the Runtime measures the loaded target's.)"""
    if not opts.reproducible or not (opts.rpc or not engine.chains_may_match(opts.flash_attn, opts.kv_type)):
        return opts
    if opts.draft is not None and not (opts.lookup_only or opts.mtp_only):
        registry.resolve(opts.draft)
    return opts.plain()


class Runtime:
    """Loaded target (and draft) models with their contexts, and the decoder to use."""

    def __init__(self, plan: Plan | RunOptions, shape_override=None):
        if isinstance(plan, RunOptions):
            plan = options_as_loaded(plan)
            self.opts = plan
            plan = build_plan(plan, shape_override)
        else:
            self.opts = None
        for note in plan.notes:
            ui.warn(note)
        quiet = self.opts.quiet if self.opts is not None else True
        if plan.attention_why:  # (a measurement chose the target's flash attention: tuning.flash_attention)
            (log.info if quiet else ui.dim)(plan.attention_why)
        self._owned: list = []
        self._memory_file = None  # where the memory of answers is saved (--memory)
        self._chat_format = None
        self.draft = self.draft_ctx = None
        # The target's one-token pass timed at load (with a profile to check), and whether it set
        # the profile aside.
        self.target_pass_s: float | None = None
        self.profile_set_aside = False
        target_load, _ = load_arguments(plan)
        with engine.captured_log() as lines:  # what llama.cpp says it allocated, checked below
            try:
                self.target = self._load(plan.files.target_path, **target_load)
                if self.opts is not None and self.opts.reproducible and plan.speculative:
                    plan = self._reproducible(plan, lines, target_load["op_offload"], shape_override)
                with engine.captured_log() as target_lines:
                    self.target_ctx = self._context(self.target, plan.target_ctx, target_load["op_offload"], plan.threads)
                if plan.check is not None:
                    plan = self._checked(plan, quiet)
                _, draft_load = load_arguments(plan)
                if plan.draft_loaded:
                    self.draft = self._load(plan.files.draft_path, **draft_load)
                    pairing.check_vocab(self.target, self.draft, plan.files.target_name, plan.files.draft_name)
                    self.draft_ctx = self._context(self.draft, plan.draft_ctx, draft_load["op_offload"], plan.threads)
                elif plan.tree is not None and plan.tree.drafting.loads_mtp:
                    # The target's MTP block drafts in a context of its own, fed the target's rows.
                    engine.enable_target_rows(self.target_ctx)
                    self.draft_ctx = engine.MtpContext(self.target, plan.target_ctx.cells, threads=plan.threads,
                                                       n_seq_max=plan.target_ctx.parallel)
                    self._owned.append(self.draft_ctx)
            except BaseException:
                self.close()
                raise
        # The target's output buffer grows to its trees' rows of logits at their first pass, as planned.
        opened = engine.Allocation.read(target_lines)
        grown = opened.with_outputs(plan.target_ctx.n_outputs, plan.target_ctx.n_seq_max)
        allocated = engine.Allocation.read(lines)
        self.allocation = replace(allocated, output=allocated.output + grown.output - opened.output)
        check_allocation(plan, self.allocation)
        self.plan = plan
        # The draft model grows its tree on while the target's pass runs elsewhere (best_first.extend).
        self.overlap = drafts_while_verifying(plan) and os.environ.get("SPECRUN_OVERLAP") != "0"
        if self.overlap:
            self.target_ctx.use_one_thread()  # (its CPU part: the batch's embeddings)
        # Trees verified over RPC workers keep to a few node counts (core.tree_shapes.NETWORK_SIZES).
        self.network_sizes = plan.target_gpu_layers > 0 and any(device.host for device in plan.devices)
        self.network_s = plan.network_s if self.network_sizes else 0.0
        self.target_ctx.network_s = self.network_s  # (prompts' passes filled to met counts: kv.CachedSequence._fill)
        self.models = plan.files
        self.shape = plan.tree.shape if plan.tree else None
        # The tokens one request may hold (the target's context holds this for each of `parallel`).
        self.n_ctx = plan.target_ctx.n_ctx
        # The answers of every request this runtime serves, read by each request's lookup.
        self.memory = OutputMemory()
        if self.opts is not None and self.opts.memory:
            self._load_memory(self.opts.memory_scope)
        try:
            self.decoders = self._decoders(plan)
        except BaseException:
            self.close()
            raise
        self.decoder = self.decoders[0]
        self._say_how_trees_verify()
        if plan.untuned and not quiet and not self.profile_set_aside:
            self._suggest_tuning()

    @property
    def chains_exact(self) -> bool:
        """Whether greedy chains verify as one-token passes here, bit for bit (kv.chains_exact,
        measured as the decoders opened; every decoder shares the target's context)."""
        return getattr(getattr(self.decoder, "sizer", None), "chains_exact", False)

    def _say_how_trees_verify(self) -> None:
        """Warn where greedy trees were expected to verify as plain decoding bit for bit (a build
        without llamafile) or a quantized cache can carry a tree pass's rounding into whole steps,
        and the target context measured otherwise as the decoders opened (kv.chains_exact)."""
        if getattr(self.decoder, "sizer", None) is None or self.decoder.chain_only or self.chains_exact:
            return
        ctx = self.target_ctx
        if engine.kv_quantized(ctx.kv_type):  # (docs/exactness.md, "A quantized KV cache")
            ui.warn(f"--kv-type {ctx.kv_type} with speculation: this target's tree passes round unlike its "
                    "one-token passes here, and the cache's quantized cells can carry that into whole steps: greedy "
                    "answers may part from plain decoding's more often (the F32 demo target: 3 of 9 at 96 tokens)")
        elif ctx.batch_invariant:  # (docs/exactness.md, "One kernel for every pass size")
            ui.warn("this build computes every pass size with one kernel, yet this target's tree passes measure unlike "
                    "its one-token passes (its weights' kernels sum by the pass's size): greedy answers may part from "
                    "plain decoding's at near-ties, as on the default build")

    def _reproducible(self, plan: Plan, lines: list[str], op_offload: bool | None, shape_override) -> Plan:
        """Every request decodes reproducibly (RunOptions.reproducible): keep the plan where the
        target's greedy chains measure as its one-token passes (kv.chains_exact, on a context opened
        for it and closed: the run's options, one batch of cells, whose answer the run's context
        reads from the record kept), else plan plain decoding: its requests decode one token a pass
        (SamplingParams.reproducible), so no draft loads. What llama.cpp logs meanwhile leaves
        `lines`, the run's allocations."""
        start = len(lines)
        probe = replace(plan.target_ctx, n_ctx=plan.target_ctx.n_batch, parallel=1)
        ctx = self._context(self.target, probe, op_offload, plan.threads)
        try:
            exact = chains_exact(ctx)
        finally:
            self._owned.remove(ctx)
            ctx.close()
        if not exact:
            plan = build_plan(self.opts.plain(), shape_override)
        del lines[start:]  # (that context's allocations, and a simulated load's for the plan, are not the run's)
        return plan

    def _load(self, path, op_offload: bool | None = None, **placement):
        model = engine.Model(path, **placement)
        self._owned.append(model)
        return model

    def _context(self, model, sizes: ContextPlan, op_offload: bool | None, threads: int):
        ctx = engine.Context(model, n_ctx=sizes.cells, n_batch=sizes.n_batch, n_seq_max=sizes.n_seq_max,
                             threads=threads, op_offload=op_offload, n_rs_seq=sizes.n_rs_seq,
                             swa_full=sizes.swa_full, flash_attn=sizes.flash_attn, kv_type=sizes.kv_type,
                             kv_unified=not sizes.split)
        self._owned.append(ctx)
        return ctx

    def _decoders(self, plan: Plan) -> list:
        """One decoder per request that may decode at once: alone, the whole target context (and the
        draft's); with --parallel N, each its own lane of the target's context and of the draft's
        (decoding.batching: a range of sequences, n_ctx tokens), their passes shared through one
        gate per context, the two gates meeting in one room."""
        n = plan.target_ctx.parallel
        offload_step = offload.op_offload_step(plan.placement, plan.devices)  # (0 without a GPU here)
        # (Each request's decoder, alone or one of several, is told where the target's passes run.)
        where = dict(overlap=self.overlap, network_sizes=self.network_sizes, network_s=self.network_s,
                     offload_step=offload_step)
        if n == 1:
            return [make_decoder(plan.tree, self.target, self.target_ctx, self.draft, self.draft_ctx,
                                 memory=self.memory, **where)]
        gate = PassGate(self.target_ctx)
        # The draft model's context, or the target's MTP context: one pass drafts for every request.
        draft_gate = PassGate(self.draft_ctx, gate.room, first=True) if self.draft_ctx is not None else None
        # Whether they draft with the draft model beside one another, in measured turns (pay.together).
        together = Together() if rules.draft_together(plan.target_gpu_layers > 0) else None
        decoders, timed = [], {}  # (the target's passes timed once for every lane: one context)
        for i in range(n):
            lane = _lane(self.target_ctx, i, n, plan.target_ctx.n_ctx, gate, prompts_join=self.opts is not None and self.opts.throughput)
            draft_lane = None
            if self.draft_ctx is not None:
                draft_lane = _lane(self.draft_ctx, i, n, plan.target_ctx.n_ctx, draft_gate)
            decoders.append(make_decoder(plan.tree, self.target, self.target_ctx, self.draft, self.draft_ctx,
                                         lane=lane, draft_lane=draft_lane, together=together, memory=self.memory,
                                         timed=timed, **where))
        return decoders

    def _load_memory(self, scope: str | None) -> None:
        """Take in the target's saved memory of answers (--memory; a corrupt or foreign file is
        one warning and a fresh memory), and save it there when the runtime closes."""
        path = self.target.path
        self._memory_model = f"{path.name}, {path.stat().st_size} bytes, vocabulary {self.target.n_vocab}"
        self._memory_file = memory_path(self._memory_model, scope)
        problem = self.memory.restore(self._memory_file, self._memory_model, self.target.n_vocab)
        if problem:
            ui.warn(problem)
        log.info("%s", memory_note(self.memory, self._memory_file))

    def _save_memory(self) -> None:
        if self._memory_file is None:
            return
        try:
            self.memory.save(self._memory_file, self._memory_model)
        except OSError as e:
            ui.warn(f"cannot save the memory of answers to {self._memory_file}: {e.strerror or e}")
        log.info("%s", memory_note(self.memory, self._memory_file))
        self._memory_file = None

    def _checked(self, plan: Plan, quiet: bool) -> Plan:
        """Time the target's one-token pass (the target is loaded, nothing else yet) and return the
        plan to load: the profile's while its timing holds, else the one made without it."""
        self.target_pass_s = target_pass_s(self.target_ctx)
        checked = plan.checked(self.target_pass_s)
        if checked is not plan:
            self.profile_set_aside = True
            if quiet:
                log.info("%s", checked.why)
            else:
                ui.dim(f"the target's passes take {self.target_pass_s * 1e3:.1f} ms now, {plan.check.pass_s * 1e3:.1f} ms "
                       "when this machine was tuned: this run decides as without the tuning profile "
                       "(`specrun tune` again if the machine changed for good)")
        return checked

    def _suggest_tuning(self) -> None:
        """Once per pair that runs without a profile (and loaded fine): say that tuning exists."""
        if profiles.first_suggestion(self.models.target_path, self.models.draft_path):
            # (and where the target attends on this CPU, its flash attention: tuning.attention)
            cpu = self.opts is not None and attention.applies(self.opts, not self.plan.devices)
            ui.dim("tip: `specrun tune` measures this machine once and picks the fastest tree for this pair"
                   + (" and whether its target's attention runs faster without flash attention, timed on the target "
                      "itself" if cpu else ""))

    @property
    def speculative(self) -> bool:
        return self.plan.speculative

    @property
    def prompts_join(self) -> bool:
        """Whether prompts go into the passes of the other requests' steps (--throughput, where
        several requests decode together: decoding.batching.Lane.prompts_join)."""
        return any(d.cache.lane.prompts_join for d in self.decoders)

    def drafting(self) -> str:
        """How `chat` and `serve` say what drafts when they start: "with draft X (tree budget 5)
        and lookup", "without a draft (plain decoding)"."""
        tree = self.plan.tree
        if tree is None:
            return "without a draft (plain decoding)"
        return tree.drafting.headline(tree, self.models.draft_name)

    @property
    def chat_format(self) -> ChatFormat:
        """Return the target's chat format (template, special tokens), made on first use."""
        if self._chat_format is None:
            self._chat_format = ChatFormat(self.target)
        return self._chat_format

    def tokenize_prompt(self, text: str, chat: bool | None = None, system: str | None = None,
                        parse_special: bool = True) -> list[int]:
        """Return the prompt's tokens (see ChatFormat.prompt_tokens)."""
        return self.chat_format.prompt_tokens(text, chat, system, parse_special)

    def tokenize_messages(self, messages: list[dict]) -> list[int]:
        """Return a conversation's tokens, rendered by the model's chat template as a chat-mode
        prompt is (message text stays text: chat.control), ready for the assistant's answer."""
        fmt = self.chat_format
        return fmt.tokenize_start(fmt.render(messages, add_generation_prompt=True))

    def clear_contexts(self) -> None:
        """Empty the target's and the draft's KV caches (for a fresh decoder on each prompt)."""
        self.target_ctx.clear()
        if self.draft_ctx is not None:
            self.draft_ctx.clear()

    def reset_cache(self) -> None:
        """Empty the KV caches (after an interrupted step left them in an unknown state)."""
        for decoder in self.decoders:
            decoder.reset()

    def close(self) -> None:
        self._save_memory()
        for owner in reversed(self._owned):
            owner.close()
        self._owned.clear()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def drafts_while_verifying(plan: Plan) -> bool:
    """Whether the draft model drafts while the target's pass runs: the target wholly on GPUs or
    RPC workers (this machine's cores wait for its passes), the draft model on this machine's CPU
    or, where the target's pass crosses a network, on a local GPU (SpecExec's regime; through
    an RPC worker 50 ms away, a target pass of 16 tokens and 16 one-token draft passes took 160
    ms together against 263 one after the other)."""
    placed = plan.placement
    across_hosts = any(device.host for device in plan.devices)  # (a draft on a local GPU waits for the network too)
    return (plan.draft_loaded and placed.target_gpu_layers > 0 and placed.target_cpu_layers <= 0
            and not placed.cpu_expert_layers and (placed.draft_device is None or across_hosts))


def target_pass_s(target_ctx) -> float | None:
    """Seconds of the target's one-token pass, timed now in its empty context (the least of three,
    after a warm-up); None where the context cannot be timed. Leaves the cache empty."""
    seconds = probe_context(target_ctx, (1,), repeats=3)
    return seconds[1] if seconds else None


def load_arguments(plan: Plan) -> tuple[dict, dict]:
    """Return how to load the target and the draft so that llama.cpp places them as planned.

    Several GPUs: the target's offloaded layers split by the planned per-device counts, the draft
    whole on its planned GPU. Op offload (GPU matmuls over RAM-resident weights for big batches)
    only where the plan made room for it; never for a draft left in RAM (its passes are narrow).
    RPC workers' devices (--rpc) take target layers only, counted before this machine's GPUs.
    Without a GPU every value is llama.cpp's default.
    """
    placed = plan.placement
    target = {"n_gpu_layers": placed.target_gpu_layers, "op_offload": None, "mmap": plan.mmap}
    if plan.tree is not None and plan.tree.drafting.loads_mtp:
        target["load_mtp"] = True
    draft = {"n_gpu_layers": plan.draft_gpu_layers, "op_offload": None}
    if not plan.devices:
        return target, draft
    target["op_offload"] = placed.op_offload
    if placed.cpu_expert_layers:
        target["experts_in_ram"] = placed.cpu_expert_layers
    if len(plan.devices) > 1 and placed.target_tensor_split:
        target["tensor_split"] = placed.target_tensor_split
    remote = sum(1 for d in plan.devices if d.host)
    if remote:
        target["across_hosts"] = True  # the draft stays on this machine (its devices only)
        target["head_here"] = plan.head_here
    if placed.draft_device is None:
        draft["op_offload"] = False
    elif len(plan.devices) - remote > 1:
        draft["main_gpu"] = placed.draft_device - remote  # among this machine's GPUs, after the workers'
    return target, draft


def _lane(ctx, i: int, n: int, n_ctx: int, gate: PassGate | None, prompts_join: bool = False) -> Lane:
    """Request i's lane of a context n requests share: the i-th nth of its sequences."""
    per = ctx.n_seq_max // n
    return Lane(ctx, range(i * per, (i + 1) * per), n_ctx, gate, prompts_join)


def make_decoder(tree: TreePlan | None, target, target_ctx, draft=None, draft_ctx=None, guard: bool = True,
                 lane: Lane | None = None, draft_lane: Lane | None = None, together: Together | None = None,
                 memory: OutputMemory | None = None, overlap: bool = False, network_sizes: bool = False,
                 network_s: float = 0.0, offload_step: int = 0, timed: dict[int, float] | None = None):
    """Return the decoder for a tree plan: plain decoding (None), or speculative decoding with the
    drafter the plan names. With `guard`, a speed guard shrinks the tree (down to plain steps)
    while speculation measures slower than plain decoding (bench and tune measure trees as given).
    The drafter lives as long as the decoder: a lookup index learns from every request it serves.
    `lane`: the decoder's share of the target's context (decoding.batching), by default all of it;
    `draft_lane` its share of the draft's; `together` the turns of the requests decoding together;
    `memory` the answers of every request the runtime served, which lookup reads (None: the
    drafter's own session text only, as `bench` and `tune` measure a fresh process); `overlap`:
    the drafter grows its tree on while the target's pass runs (drafts_while_verifying);
    `network_sizes`: trees keep to core.tree_shapes.NETWORK_SIZES or to node counts met before
    (a target on RPC workers, whose passes spend `network_s` seconds on the network);
    `offload_step`: the target's passes of that many tokens or more cost another regime
    (hardware.offload.op_offload_step); `timed` the target's passes timed by the decoders built
    before this one at the same start (drafters.Drafting.build).
    """
    if tree is None:
        return PlainDecoder(target, target_ctx, lane)
    shape = tree.verified
    speed_guard = SpeedGuard(shape.budget, plain_s=tree.plain_s) if guard else None
    drafter = tree.drafting.build(tree, draft, draft_ctx, target_ctx, draft_lane, memory, timed)
    decoder = SpeculativeDecoder(target, target_ctx, drafter, shape, guard=speed_guard, lane=lane, together=together)
    decoder.overlap, decoder.network_sizes, decoder.network_s = overlap, network_sizes, network_s
    if overlap or network_sizes:  # (a pass elsewhere: a new count of tokens may cost round trips)
        drafter.first_passes_apart()
    if overlap:
        drafter.overlaps()
    if offload_step:
        drafter.cost_step(offload_step)
    return decoder
