"""Models named by Hugging Face repo id: the local HF cache first, else a download with huggingface_hub.

`owner/name` or `owner/name@revision` (a branch, tag or commit hash; a commit pins the files for good).
The files fetched are mlx-lm's own `DEFAULT_ALLOW_PATTERNS` (config, safetensors, tokenizer), so a
repo holds the same files here as after `mlx_lm.generate --model ID`. huggingface_hub reads HF_TOKEN
(gated and private repos), HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE itself; HF_HOME / HF_HUB_CACHE
say where the cache lives. A per-repo file lock makes replicas of one host download once: the others
wait and then find the files in the cache.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from modelio.cache_root import cache_dir, file_lock

log = logging.getLogger("pomona.models")

Progress = Callable[[int, "int | None"], None]  # (bytes done, bytes total or None)
LOG_EVERY_S = 5.0
CONVERT_ADVICE = ("Pick an MLX version of it (most models have one under https://huggingface.co/mlx-community), "
                  "or convert the original checkpoint: `mlx_lm.convert --hf-path ORIGINAL_REPO --mlx-path DIR`, "
                  "then serve DIR.")


class HubModelError(ValueError):
    """A hub model that cannot be served; the message says what to do."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None  # None: the default branch

    @classmethod
    def parse(cls, name: str) -> "HubRef":
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        repo_id, _, revision = name.partition("@")
        try:
            validate_repo_id(repo_id)
        except HFValidationError as exc:
            raise HubModelError(
                f"model {name!r} is neither a local model directory nor a valid Hugging Face repo id ({exc}). "
                "Pass a local mlx-lm directory (one with config.json), 'owner/name[@revision]' of a hub "
                "model, or 'default' for SmolLM2-135M-Instruct.") from exc
        return cls(repo_id, revision or None)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def allow_patterns(weights: bool = True) -> list[str]:
    """mlx-lm's files; without `weights`, what the tokenizer and config need (for the ingress)."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return [p for p in DEFAULT_ALLOW_PATTERNS if weights or not p.endswith(".safetensors")]


def lock_path(ref: HubRef) -> Path:
    return cache_dir() / "locks" / f"hub-{ref.repo_id.replace('/', '--')}.lock"


def cached(ref: HubRef, weights: bool = True) -> Path | None:
    """The complete cached snapshot of `ref` (mlx-lm's files), or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=allow_patterns(weights),
                                      local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):  # not cached (or incomplete), or not a valid repo id
        return None
    return path if (path / "config.json").is_file() else None


def check_files(ref: HubRef, files: list[str]) -> None:
    """Refuse, before downloading anything, a repo that holds no mlx-lm model."""
    names = [f.rsplit("/", 1)[-1] for f in files]
    if "config.json" in names and any(n.startswith("model") and n.endswith(".safetensors") for n in names):
        return
    if any(n.endswith(".gguf") for n in names):
        raise HubModelError(f"model {str(ref)!r} holds only GGUF files, and Pomona serves mlx-lm models "
                            f"(config.json + safetensors). {CONVERT_ADVICE}")
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names) or "config.json" in names:
        raise HubModelError(f"model {str(ref)!r} has no safetensors weights in mlx-lm's layout (a PyTorch-only "
                            f"or otherwise non-MLX checkpoint). {CONVERT_ADVICE}")
    raise HubModelError(f"repo {str(ref)!r} holds no model files (no config.json, no safetensors weights). "
                        "Check the id on https://huggingface.co.")


def _explain(ref: HubRef, exc: BaseException) -> HubModelError:
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    endpoint = constants.ENDPOINT
    if isinstance(exc, GatedRepoError):
        return gated_error(ref)
    if isinstance(exc, RepositoryNotFoundError):
        return HubModelError(f"model {ref.repo_id!r} was not found on {endpoint}: check the id (owner/name); if "
                             "the repo is private, set HF_TOKEN to a token that can read it.")
    if isinstance(exc, RevisionNotFoundError):
        return HubModelError(f"model {ref.repo_id!r} has no revision {ref.revision!r}: name an existing branch, "
                             "tag or commit after '@', or leave it out for the default branch.")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code < 500:
        return HubModelError(f"the Hub refused {str(ref)!r} ({exc.response.status_code}): {exc}")
    if isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError)) and constants.HF_HUB_OFFLINE:
        return offline_error(ref)
    return HubModelError(
        f"could not download {str(ref)!r} from {endpoint} ({type(exc).__name__}: {exc}). Check this host's "
        "network (and HF_ENDPOINT if you use a mirror) and retry; or download it where the Hub is reachable "
        f"with `pomona models pull {ref}` and copy the Hugging Face cache (~/.cache/huggingface/hub) here.")


def gated_error(ref: HubRef) -> HubModelError:
    from huggingface_hub import constants

    return HubModelError(f"model {ref.repo_id!r} is gated: accept its terms at {constants.ENDPOINT}/{ref.repo_id} "
                         "while logged in, then set HF_TOKEN to an access token of that account (on every host "
                         "that serves it) or run `hf auth login`.")


def offline_error(ref: HubRef) -> HubModelError:
    return HubModelError(
        f"model {str(ref)!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so it cannot be "
        f"downloaded. Unset HF_HUB_OFFLINE, or run `pomona models pull {ref}` on a host with network and copy "
        "its Hugging Face cache (~/.cache/huggingface/hub) here, or pass a local model directory.")


def _wanted(info: Any, weights: bool) -> tuple[list[str], int | None]:
    from huggingface_hub.utils import filter_repo_objects

    files = [s.rfilename for s in info.siblings or []]
    keep = set(filter_repo_objects(files, allow_patterns=allow_patterns(weights)))
    sizes = [s.size for s in info.siblings or [] if s.rfilename in keep]
    return files, (sum(sizes) if sizes and None not in sizes else None)


def progress_bar_class(report: Progress, total: int | None) -> type[tqdm]:
    """A silent tqdm for `snapshot_download` whose bytes bar feeds `report(done, total)`."""

    class _Sink:
        def write(self, _: str) -> None: ...
        def flush(self) -> None: ...

    class Bar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs.update(file=_Sink(), disable=False)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            # The bytes written to disk; "Downloading bytes" counts network transfer (xet may compress).
            if self.unit == "B" and not str(self.desc).startswith("Downloading bytes"):
                report(int(self.n), total or (int(self.total) if self.total else None))
            return out

    return Bar


def log_progress(ref: HubRef) -> Progress:
    """A reporter that writes a line to the log every LOG_EVERY_S seconds (the replica's log)."""
    last = [0.0]

    def report(done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - last[0] >= LOG_EVERY_S or (total and done >= total):
            last[0] = now
            share = f" ({100 * done / total:.0f}%)" if total else ""
            log.info("downloading %s: %.1f / %s MB%s", ref, done / 1e6, f"{total / 1e6:.1f}" if total else "?", share)
    return report


def download(ref: HubRef, report: Progress | None = None, weights: bool = True) -> Path:
    """Fetch mlx-lm's files of `ref` into the HF cache (skipping files already there); network required."""
    from huggingface_hub import HfApi, get_token, snapshot_download

    try:
        info = HfApi().model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    except Exception as exc:  # every failure gets advice; a bug in ours still shows as the cause
        raise _explain(ref, exc) from exc
    files, total = _wanted(info, weights)
    check_files(ref, files)
    if info.gated and not get_token():
        raise gated_error(ref)
    reporter = report or log_progress(ref)
    reporter(0, total)
    started = time.monotonic()
    try:
        # By revision, not info.sha: huggingface_hub then records the branch -> commit ref that later
        # offline look-ups of the branch need.
        path = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=allow_patterns(weights),
                                      tqdm_class=progress_bar_class(reporter, total)))
    except Exception as exc:
        raise _explain(ref, exc) from exc
    log.info("downloaded %s (commit %s) in %.1f s to %s", ref, info.sha, time.monotonic() - started, path)
    return path


def resolve(name: str, report: Progress | None = None, weights: bool = True) -> Path:
    """The cached snapshot of a hub id, downloading it (once per host) when it is not cached."""
    from huggingface_hub import is_offline_mode

    ref = HubRef.parse(name)
    found = cached(ref, weights)
    if found is not None:
        return found
    if is_offline_mode():
        raise offline_error(ref)
    log.info("model %s is not in the Hugging Face cache (%s): downloading", ref,
             os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface")
    with file_lock(lock_path(ref)):
        found = cached(ref, weights)  # another replica of this host may have finished while we waited
        return found if found is not None else download(ref, report, weights)


def pull(name: str, report: Progress | None = None) -> Path:
    """Download (or bring up to date) a hub model ahead of serving: `pomona models pull ID`."""
    from huggingface_hub import is_offline_mode

    ref = HubRef.parse(name)
    if is_offline_mode():
        found = cached(ref)
        if found is None:
            raise offline_error(ref)
        return found
    with file_lock(lock_path(ref)):
        return download(ref, report)
