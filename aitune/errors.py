"""The one exception tree of aitune.

Every error aitune raises on purpose derives from :class:`AITuneError`. Third-party exceptions are
translated at the backend boundary with ``raise ... from exc`` so the original cause stays chained.
"""

from __future__ import annotations

from pathlib import Path


class AITuneError(Exception):
    """Base class of every error raised by aitune."""


class ConfigError(AITuneError, ValueError):
    """A configuration value, argument or dataset is invalid; the message says which and how to fix it."""


class UnknownArgumentError(ConfigError, TypeError):
    """A misspelled or unknown keyword argument; the message lists the valid ones (also a ``TypeError``, as
    Python raises for unexpected keywords)."""


class OnnxFileError(ConfigError):
    """An ONNX file cannot be used as it is (:class:`aitune.torch.OnnxModule`): missing, not a valid model, an
    unsupported input type, or external data outside the model's folder; the message names the file and the fix."""


class OnnxInputError(ConfigError, TypeError):
    """A call to an :class:`aitune.torch.OnnxModule` does not match the ONNX file's inputs (count, names, dtype,
    rank or a fixed size); the message names the input and what the file declares (also a ``TypeError``, as
    Python raises for a call that does not fit a signature)."""


class UnknownBackendError(AITuneError, KeyError):
    """A backend name is not registered; the message lists every registered name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(AITuneError):
    """A backend cannot run here (package missing, wrong device, ...); the message names the fix."""


class BackendStateError(AITuneError, RuntimeError):
    """A backend method was called in a state that does not allow it (e.g. build twice)."""


class BackendBuildError(AITuneError):
    """A backend failed to build a module.

    Attributes:
        backend: registered name of the backend.
        config_key: the backend config's key (sha256 hex).
        log_path: path of the build log, if one was written.
    """

    def __init__(self, message: str, *, backend: str = "", config_key: str = "", log_path: Path | None = None):
        super().__init__(message)
        self.backend = backend
        self.config_key = config_key
        self.log_path = log_path

    def __str__(self) -> str:
        text = super().__str__()
        if self.log_path is not None:
            text += f" (log: {self.log_path})"
        return text


class IsolatedStepError(BackendBuildError):
    """A build step run in a child process (``aitune.torch.backend.isolation.run_isolated``) failed.

    The message is one line: ``killed by signal SIGSEGV``, ``aborted (SIGABRT)``, ``timed out after 30.0 s``,
    ``exited with code 3``, or the child's exception type and message.

    Attributes:
        target: the step that ran (``package.module:function``).
        returncode: the child's exit status (negative: killed by that signal), None after a timeout.
        signal_name: e.g. ``"SIGSEGV"`` when a signal ended the child, else None.
        timed_out: True when the child ran past its timeout and was killed.
        error_type: class name of the exception the step raised, else None.
    """

    def __init__(self, message: str, *, target: str = "", returncode: int | None = None,
                 signal_name: str | None = None, timed_out: bool = False, error_type: str | None = None,
                 **kwargs):
        super().__init__(message, **kwargs)
        self.target = target
        self.returncode = returncode
        self.signal_name = signal_name
        self.timed_out = timed_out
        self.error_type = error_type


class BackendRuntimeError(AITuneError, RuntimeError):
    """A built backend failed while running inference."""


class CorrectnessError(AITuneError):
    """A candidate's outputs do not agree with eager PyTorch."""


class ShapeMismatchError(CorrectnessError):
    """Output structure, shape, dtype or device differs from eager."""


class ToleranceExceededError(CorrectnessError):
    """Values differ from eager by more than the tolerance.

    Attributes:
        leaf: path of the output leaf that failed, e.g. ``"[0]['logits']"``.
        max_abs_error: largest ``|candidate - eager|`` over the leaf.
        max_rel_error: largest ``|candidate - eager|`` over the leaf divided by the leaf's largest ``|eager|``.
        tolerance: a description of the tolerance that was applied.
    """

    def __init__(self, message: str, *, leaf: str = "", max_abs_error: float = float("nan"),
                 max_rel_error: float = float("nan"), tolerance: str = ""):
        super().__init__(message)
        self.leaf = leaf
        self.max_abs_error = max_abs_error
        self.max_rel_error = max_rel_error
        self.tolerance = tolerance


class TuningError(AITuneError, RuntimeError):
    """Tuning could not pick any backend (e.g. a latency budget nobody meets)."""


class CheckpointError(AITuneError):
    """A checkpoint cannot be written or read."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint was written by a newer format version than this aitune reads."""


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint's contents do not match its digests, or its layout is unsafe or incomplete."""


class ServeError(AITuneError):
    """A served model cannot start or run (``aitune.serve``): the message says which step and why."""


class RequestError(ServeError, ValueError):
    """A request to a served model is malformed or does not fit the tuned inputs; the replica lives on.

    Attributes:
        status: the HTTP status it is answered with (400: not the documented JSON form; 422: well formed but
            it does not fit the tuned module's inputs, or the model raised on it).
        field: the request field at fault (``inputs.input_ids``), or ``""``.
    """

    def __init__(self, message: str, *, status: int = 422, field: str = ""):
        super().__init__(message)
        self.status = status
        self.field = field

    def __reduce__(self):  # keeps status and field across Ray's process boundary (pickled with the message)
        return (_rebuild_request_error, (str(self), self.status, self.field))


def _rebuild_request_error(message: str, status: int, field: str) -> "RequestError":
    return RequestError(message, status=status, field=field)


def one_line(exc: BaseException, limit: int = 300, *, lines: int = 1, type_name: bool = True) -> str:
    """First meaningful line(s) of an exception, for report 'reason' columns and error messages.

    Kept here, below every layer (backends, kernel forge, strategies, checkpoints, serving), which import it from
    here.

    Args:
        exc: the exception. limit: the most characters returned (a longer text ends with "…").
        lines: how many non-blank lines of the message to keep, joined by spaces (``load_state_dict`` puts the
            useful part on its second line). type_name: prefix the exception's type name (``"ValueError: ..."``).

    Returns:
        The text; the type name alone when the message is empty.
    """
    kept = [line.strip() for line in str(exc).strip().splitlines() if line.strip()][:lines]
    text = " ".join(kept)
    message = (f"{type(exc).__name__}: {text}" if type_name else text) if text else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 1] + "…"
