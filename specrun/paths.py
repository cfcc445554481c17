"""Where specrun keeps its files: one cache directory and one config directory.

SPECRUN_HOME moves the cache (models made or fetched by specrun, tuning profiles);
SPECRUN_CONFIG moves the config directory (the user's models.toml). Hugging Face downloads go to
the standard Hugging Face cache so other tools share them.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Return specrun's cache directory (not created)."""
    env = os.environ.get("SPECRUN_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specrun"


def config_dir() -> Path:
    """Return specrun's config directory (not created)."""
    env = os.environ.get("SPECRUN_CONFIG")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "specrun"


def models_dir() -> Path:
    """Return the directory for models specrun builds or unpacks itself (PyPI-shipped, derived)."""
    return cache_dir() / "models"


def profiles_dir() -> Path:
    """Return the directory for tuning profiles (SPECRUN_PROFILES overrides)."""
    env = os.environ.get("SPECRUN_PROFILES")
    return Path(env).expanduser() if env else cache_dir() / "profiles"


def memory_dir() -> Path:
    """Return the directory for saved memories of answers (`--memory`; SPECRUN_MEMORY overrides)."""
    env = os.environ.get("SPECRUN_MEMORY")
    return Path(env).expanduser() if env else cache_dir() / "memory"


def worker_cache_dir() -> Path:
    """Return the directory where `specrun worker --cache` keeps the weights clients sent
    (SPECRUN_WORKER_CACHE overrides)."""
    env = os.environ.get("SPECRUN_WORKER_CACHE")
    return Path(env).expanduser() if env else cache_dir() / "worker"


def user_models_toml() -> Path:
    """Return the path of the user's own models.toml (may not exist)."""
    return config_dir() / "models.toml"
