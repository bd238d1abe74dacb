"""Every error of the project, in one tree under one base class, each with the operator's next step.

An error here is one a person can act on: its message says what is wrong (the file and line, the figures,
the knob), and its class's `what_to_do` says what to do next. The assets turn any of them into a Dagster
failure in one place (`eagle3_assets.common.failures`), whose description ends with that step.

    Eagle3Error                        the base: `what_to_do` is the operator's next step
    ├── InputError                     the project's inputs, read before anything is spent
    │   ├── RegistryError              (ValueError) data/datasets.yaml is malformed or lacks the dataset
    │   ├── PromptFileError            (ValueError) a prompt file's problems, each with its line (`path`, `problems`)
    │   ├── InvalidPrompt              (ValueError) one prompt is not in the project's format
    │   ├── ToolSchemaError            (ValueError) a tool's JSON schema cannot be declared the way Kimi does
    │   ├── SourceError                (ValueError) a public source cannot be read at all (no files, a column missing)
    │   ├── TokenizerFolderError       (ValueError) a tokenizer folder is missing, malformed or off in its ids
    │   ├── StandinWeightsMismatch     (ValueError) the shipped stand-in weights were fitted for another tokenizer
    │   └── RateUnreadable             (ValueError) a measurement file lacks the rate a streaming plan asks of it
    ├── CompletionsError               a completions run and the provider it pays
    │   ├── DatasetBusy                (RuntimeError) another run holds the dataset's lock
    │   ├── RunFatalError              (RuntimeError) the whole run must stop: bad key, no credits, no endpoint
    │   ├── AccountError               (RuntimeError) the provider's account API refused (`status`)
    │   └── StreamError                a stream carried an error chunk or ended truncated (`code`)
    ├── StoreError                     the hidden-state store and the disk under it
    │   ├── DiskSpaceError             (RuntimeError) the volume cannot hold the extraction
    │   ├── StaleShardsError           (RuntimeError) committed shards would be discarded by a changed plan
    │   ├── SpoolTooSmall              (ValueError) the streaming spool's budget cannot hold its working set
    │   ├── SpoolStateError            (RuntimeError) the spool's files disagree with this run, or a shard is damaged
    │   ├── CaptureFailed              (RuntimeError) streaming: the capture process ended while the trainer waited
    │   ├── SpoolBusy                  (RuntimeError) streaming: a lane's writer lock or the trainer lock is held
    │   ├── SpoolFenced                (RuntimeError) streaming: a later side took this side's lease; it must not write
    │   └── SharedFileUnreadable       (OSError) streaming: ESTALE or EIO on every retried read of a shared file
    ├── BackendError                   the SGLang hidden-state backend
    │   ├── SGLangUnavailable          (RuntimeError) this host cannot run it
    │   ├── RankError                  (RuntimeError) a rank process failed or died
    │   ├── KVPoolExhausted            (RuntimeError) a batch's KV slots could not be allocated
    │   ├── HandoffMemoryError         (RuntimeError) /dev/shm cannot hold the hand-off slabs
    │   └── SlabsHeld                  (RuntimeError) the caller holds every slab rank 0 waits for
    └── DrafterError                   the trained drafter and its recorded figures
        ├── FiguresRefused             a benchmark's JSON cannot be recorded on the drafter
        └── StreamingTrainingFailed    (RuntimeError) streaming: the training side ended with an error

The builtin in brackets is a second base kept for the callers that catch it (`except ValueError`). Private
control-flow signals that never leave their module (`openrouter._Retry`, `_Final`, `sglang_backend._Stop`)
are not errors and stay where they are used. tests/test_errors.py fails on an error class defined anywhere
else, or on one without a `what_to_do`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

MAX_ERRORS_SHOWN = 25  # problems of a prompt file listed in its error; the rest are counted


class Eagle3Error(Exception):
    """The base of every error of the project; `what_to_do` is the operator's next step."""

    what_to_do: ClassVar[str] = "read the message above: it names what is wrong; fix it and materialize again"


# -- inputs ----------------------------------------------------------------------------------------


class InputError(Eagle3Error):
    """The project's inputs (registry, prompt files, public sources, tokenizer) are wrong; nothing was spent."""

    what_to_do: ClassVar[str] = "fix the input the message names and materialize again; nothing was spent"


class RegistryError(InputError, ValueError):
    """The registry file is malformed, or names a dataset it does not hold."""

    what_to_do: ClassVar[str] = (
        "fix data/datasets.yaml (or the dataset name asked for) as the message says, then materialize again"
    )


@dataclass
class PromptFileError(InputError, ValueError):
    """One or more problems in a prompt file, each with its line."""

    what_to_do: ClassVar[str] = (
        "fix each listed line of the prompt file (path:line: problem), then materialize raw_prompts again"
    )

    path: Path
    problems: list[tuple[int | None, str]] = field(default_factory=list)

    def __str__(self) -> str:
        shown = [
            f"{self.path}:{line}: {msg}" if line else f"{self.path}: {msg}"
            for line, msg in self.problems[:MAX_ERRORS_SHOWN]
        ]
        more = len(self.problems) - MAX_ERRORS_SHOWN
        if more > 0:
            shown.append(f"... and {more} more problem(s)")
        return f"{len(self.problems)} problem(s) in {self.path}:\n" + "\n".join(shown)


class InvalidPrompt(InputError, ValueError):
    """One prompt is not in the project's format (the message says what is wrong)."""

    what_to_do: ClassVar[str] = (
        "correct the prompt as the message says (a sample file's line), or let the importer skip it"
    )


class ToolSchemaError(InputError, ValueError):
    """A tool's JSON schema cannot be declared the way Kimi declares tools."""

    what_to_do: ClassVar[str] = "rewrite the tool's JSON schema with the types and keywords Kimi's declaration supports"


class SourceError(InputError, ValueError):
    """The source cannot be read at all (no files, a missing column): a setting to fix, not a bad row."""

    what_to_do: ClassVar[str] = (
        "fix the dataset's `import:` entry in data/datasets.yaml, or provide its files under "
        "EAGLE3_SOURCES_DIR, as the message says"
    )


class TokenizerFolderError(InputError, ValueError):
    """A tokenizer folder is missing, malformed, or has special tokens at unexpected ids."""

    what_to_do: ClassVar[str] = (
        "point the tokenizer resource at a complete Kimi-K2.5 tokenizer folder "
        "(tiktoken.model and tokenizer_config.json of the pinned revision)"
    )


class StandinWeightsMismatch(InputError, ValueError):
    """The stand-in target's shipped weights were fitted for another tokenizer, builder or fit settings, or their
    tensors do not fit the stand-in's shape."""

    what_to_do: ClassVar[str] = (
        "regenerate data/standin/target.safetensors (python -m eagle3_resources.target.standin_weights) after "
        "changing the stand-in's builder, its settings or the prompt corpus"
    )


# -- completions -----------------------------------------------------------------------------------


class RateUnreadable(InputError, ValueError):
    """A measurement file (device_check.py's or gpu-check's JSON) that does not give the rate a streaming plan asks of
    it: the file, the key and what is wrong."""

    what_to_do: ClassVar[str] = (
        "give the plan a file that measured that figure (a device check or gpu-check run that completed the section "
        "or row, at the target's width), or give the rate as a number, labelled assumed"
    )

    def __init__(self, path: object, key: str, problem: str):
        super().__init__(f"{path}: {key}: {problem}")


class CompletionsError(Eagle3Error):
    """A completions run, or the provider it pays, cannot go on."""

    what_to_do: ClassVar[str] = (
        "every finished response is in the journal: fix the cause and materialize again to resume"
    )


class DatasetBusy(CompletionsError, RuntimeError):
    """Another run holds the dataset's lock."""

    what_to_do: ClassVar[str] = (
        "wait for the run named in the message to finish (or terminate it), then materialize this dataset again"
    )


class RunFatalError(CompletionsError, RuntimeError):
    """The whole run must stop: bad key, no credits, no endpoint after provider filters."""

    what_to_do: ClassVar[str] = (
        "fix the cause the message names (the API key, the account's credits, the provider "
        "routing), then materialize again: finished responses are kept"
    )


class AccountError(CompletionsError, RuntimeError):
    """The provider's account API answered with an error status."""

    what_to_do: ClassVar[str] = (
        "check the API key and the provider's status for the HTTP status in the message, then try again"
    )

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class StreamError(CompletionsError):
    """The stream carried an error chunk, or ended without [DONE] (truncated)."""

    what_to_do: ClassVar[str] = "nothing by hand: the request is retried, or recorded as failed by its error code"

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


# -- the hidden-state store ------------------------------------------------------------------------


class StoreError(Eagle3Error):
    """The hidden-state store, or the disk under it, refuses the extraction."""

    what_to_do: ClassVar[str] = "read the figures in the message and change the store's settings or its volume"


class DiskSpaceError(StoreError, RuntimeError):
    """The volume cannot hold what the extraction would write (raised before any byte is written)."""

    what_to_do: ClassVar[str] = (
        "free space on the data volume, or lower `max_tokens` / `dataset_weights` in the "
        "hidden_states run config, then materialize again: nothing was written"
    )


class StaleShardsError(StoreError, RuntimeError):
    """Committed shards would be deleted because the plan changed; refused unless asked for (GPU hours are at stake)."""

    what_to_do: ClassVar[str] = (
        "restore the plan the shards were written with, or set `discard_stale_shards: true` "
        "in the hidden_states run config to delete them and extract again"
    )


class SpoolTooSmall(StoreError, ValueError):
    """The streaming spool's byte budget cannot hold the minimum working set (refused before anything starts)."""

    what_to_do: ClassVar[str] = (
        "raise the spool's byte budget, or lower shard_gb, the passes per token or the capture hosts sharing "
        "it, as the figures in the message say; nothing was captured or trained"
    )


class SpoolStateError(StoreError, RuntimeError):
    """The spool's files disagree with this run (other settings or capture plan, a trainer position behind the
    spool's), or a shard's bytes are not its recorded checksum's."""

    what_to_do: ClassVar[str] = (
        "use a new spool folder for new settings or a new plan; resume the trainer from its latest checkpoint; "
        "for a damaged shard, restart its capture lane with verify_on_resume (it captures the shard again), "
        "then the trainer"
    )


class CaptureFailed(StoreError, RuntimeError):
    """Streaming mode: the capture process ended (or died) while the trainer was waiting for its shards."""

    what_to_do: ClassVar[str] = (
        "read the capture's log quoted in the message (also in <drafter>.streaming/), fix its cause and run the "
        "drafter again: the spool and the trainer's checkpoint are kept, and both sides resume where they stopped"
    )


class SpoolBusy(StoreError, RuntimeError):
    """Streaming mode: another process holds a spool lane's writer lock or the spool's trainer lock (one writer a
    lane, one trainer a spool); this side waited for it and gave up."""

    what_to_do: ClassVar[str] = (
        "the message names the holder (host and pid): a side of an earlier run that has not ended yet exits by itself "
        "once its orchestrator's heartbeat stops (orphan_after_s); if it is another live run, wait for it or stop it, "
        "then materialize again"
    )


class SpoolFenced(StoreError, RuntimeError):
    """Streaming mode: this side's lease on its lane (or the trainer's on the spool) is no longer the newest: another
    side took it since (this one stalled past its lock, or the file system's lock was not exclusive), so this side
    refuses to publish a shard or write the trainer's ledger beside it (lease.py)."""

    what_to_do: ClassVar[str] = (
        "nothing to repair: the side that took the lease later goes on, and this one has written nothing since; if no "
        "other side should be running, look for a second orchestrator or a side of an earlier run on the host the "
        "message names"
    )


class SharedFileUnreadable(StoreError, OSError):
    """Streaming mode: a file the sides share (the spool's, the run folder's) failed with ESTALE or EIO on every try
    of a short backoff (shared_fs.py): not a blip of the shared file system. An OSError with that errno and file."""

    what_to_do: ClassVar[str] = (
        "check the shared file system under the file the message names (its mount, the server's health, this host's "
        "kernel log); once it reads again, materialize again: both sides resume where they stopped"
    )


# -- the SGLang backend ----------------------------------------------------------------------------


class BackendError(Eagle3Error):
    """The SGLang hidden-state backend cannot run, or failed while running."""

    what_to_do: ClassVar[str] = "read the rank's message; `eagle3 gpu-check` checks the host before a long run"


class SGLangUnavailable(BackendError, RuntimeError):
    """This host cannot run the SGLang backend (no sglang, no CUDA, too few GPUs, API drift)."""

    what_to_do: ClassVar[str] = (
        "run on a host with the pinned SGLang and enough GPUs (`eagle3 gpu-check` says what is "
        "missing), or choose the transformers backend"
    )


class RankError(BackendError, RuntimeError):
    """A rank process failed or died."""

    what_to_do: ClassVar[str] = (
        "read the rank's traceback in the message (and the run's logs), fix its cause, then "
        "materialize again: committed shards are kept"
    )


class KVPoolExhausted(BackendError, RuntimeError):
    """SGLang could not allocate a batch's KV slots (raised in the rank, with the figures and the knobs)."""

    what_to_do: ClassVar[str] = (
        "lower a forward's size (its tokens or requests) or raise SGLang's memory fraction: the message "
        "names the knobs and the figures"
    )


class HandoffMemoryError(BackendError, RuntimeError):
    """/dev/shm cannot hold the hand-off slabs."""

    what_to_do: ClassVar[str] = "give the container a larger /dev/shm (--shm-size), or lower sglang_handoff_slabs"


class SlabsHeld(BackendError, RuntimeError):
    """Rank 0 waits for a free slab and the caller holds every one: release some rows, then ask again."""

    what_to_do: ClassVar[str] = "release the rows already read (Rows.release()) before asking for the next batch"


# -- the drafter -----------------------------------------------------------------------------------


class DrafterError(Eagle3Error):
    """The trained drafter, or the figures recorded on it, are refused."""

    what_to_do: ClassVar[str] = "read the message: it names the drafter or the report that was refused"


class FiguresRefused(DrafterError):
    """The benchmark's JSON cannot be recorded (not one of ours, or its drafter's weights changed since)."""

    what_to_do: ClassVar[str] = (
        "run the benchmark again on this drafter (benchmarks/serving_speculative.py or "
        "sglang_engine_speculative.py) and record its JSON"
    )


class StreamingTrainingFailed(DrafterError, RuntimeError):
    """Streaming mode: the training side ended with an error (or was stopped) before exporting the drafter."""

    what_to_do: ClassVar[str] = (
        "read the training side's log quoted in the message (also in <drafter>.streaming/training.log), fix its cause "
        "and run the drafter again: the spool and the trainer's checkpoint are kept, and both sides resume"
    )
