"""The model files a run names, found or fetched: the target, its draft (named, the registry's
recommended one, or the default pair's) or the target's own MTP layers, each pair checked before
anything downloads (runtime.plan plans from what this returns)."""

from __future__ import annotations

from pathlib import Path

from specrun import engine, ui
from specrun.errors import UsageError
from specrun.models import hub, pairing, registry
from specrun.runtime.options import ModelFiles, RunOptions


def resolve_models(opts: RunOptions, fetch: bool = True) -> ModelFiles:
    """Return the target's and draft's local paths, fetching what is missing (after saying what);
    with fetch=False nothing is downloaded: a missing model's path is None."""
    if opts.target is None:
        target_name, default_draft = registry.default_pair()
    else:
        target_name, default_draft = opts.target, None
    target_spec = registry.resolve(target_name)
    draft_spec = None
    if opts.no_spec and (opts.lookup is True or opts.lookup_only or opts.mtp_only):
        raise UsageError("--no-spec decodes without drafting: it does not go with --lookup, --draft lookup or --draft mtp")
    if opts.no_spec and opts.draft is not None:
        registry.resolve(opts.draft)  # not loaded, but a misspelt name is still the error it is elsewhere
    # A target that carries MTP layers drafts with them unless a draft model is named (the file
    # says so once on disk; the registry's `mtp = true` before the download).
    target_path = None
    target_has_mtp = target_spec.mtp
    if opts.draft is None and not opts.no_spec:
        target_path = _local_path(target_spec, opts.quiet, fetch)
        target_has_mtp = has_mtp_layers(target_spec, target_path)
    auto_mtp = opts.draft is None and not opts.no_spec and opts.lookup is not True and target_has_mtp
    if not opts.no_spec and not opts.lookup_only and not opts.mtp_only and not auto_mtp:
        if opts.draft is not None:
            draft_spec = registry.resolve(opts.draft)
        elif default_draft is not None and opts.target is None:
            draft_spec = registry.resolve(default_draft)
        else:
            draft_spec = registry.recommended_draft(target_spec)
        if draft_spec is not None:
            pairing.check_pair(target_spec, draft_spec)
    if target_path is None:
        target_path = _local_path(target_spec, opts.quiet, fetch)
    draft_path = _local_path(draft_spec, opts.quiet, fetch) if draft_spec is not None else None
    mtp_why = ""
    if opts.mtp_only:
        if not has_mtp_layers(target_spec, target_path):
            raise UsageError(f"--draft mtp: {target_spec.name} has no MTP layers (llama.cpp's nextn layers); "
                             "pass a draft model, --draft lookup, or a file that keeps them (the *-mtp registry entries)")
        mtp_why = "--draft mtp: the target's own MTP layers draft"
    elif auto_mtp:
        mtp_why = (f"{target_spec.name} carries MTP layers and no draft model was given: they draft "
                   "(--draft MODEL or --draft lookup to choose otherwise)")
    return ModelFiles(target_spec.name, target_path, draft_spec.name if draft_spec else None, draft_path,
                      mtp=bool(mtp_why), mtp_why=mtp_why)


def has_mtp_layers(spec, path: Path | None) -> bool:
    """Whether the target carries MTP layers: its file's header says, else the registry's `mtp`."""
    if path is not None:
        return engine.gguf_has_mtp_layers(path)
    return bool(spec.mtp)


def _local_path(spec, quiet: bool, fetch: bool) -> Path | None:
    """Return the model's local path; a missing model is announced (what, how big) and fetched."""
    if not fetch:
        return Path(hub.ensure_local(spec, progress=False, allow_download=False)) if hub.is_present(spec) else None
    missing = hub.describe_missing(spec)
    if missing and not quiet:
        ui.info(f"pulling {missing}...")
    return Path(hub.ensure_local(spec, progress=not quiet, console=ui.err_console()))
