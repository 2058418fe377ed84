"""Typed errors of the hot-plug subsystem.

Every message is one line naming the file (or expert) and what was expected. Each refusal
also carries a short machine-readable `reason` code, which the manager puts in the
`info["reason"]` of its "rejected" event.
"""
from __future__ import annotations

from colibri_core.errors import ExpertError

# Every refusal is logged as this one line (logger "colibri.hotplug", level WARNING), with
# the arguments (path of the refused file, the rule: the error's `reason`, the error).
REFUSED_LOG = "hot-plug refused %s (rule %s): %s"


class HotplugError(ExpertError):
    """Base class of the hot-plug errors. A server answers a refusal with 400 and its
    `reason` as the code (`code` below follows `reason`)."""

    reason = "error"

    @property
    def code(self) -> str:          # the server's error code is the refusal's reason
        return self.reason

    def __init__(self, message: str, *, reason: str | None = None, path: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.path = path


# ----------------------------------------------------------------------------- refusals

class ExpertRejected(HotplugError, ValueError):
    """An expert file was refused before loading (base class of every check failure)."""

    reason = "rejected"
    http_status = 400
    error_type = "invalid_request_error"


class ElfFormatError(ExpertRejected):
    """Not an ELF shared object, a truncated one, or one for another class/machine."""

    reason = "elf"


class ExpertIncomplete(ElfFormatError):
    """The file is shorter than its own headers say: still being written, or truncated."""

    reason = "incomplete"


class ArchitectureMismatch(ElfFormatError):
    """ELF class, byte order, machine or OS ABI differs from the running host."""

    reason = "architecture"


class ExpertAbiError(ExpertRejected):
    """Metadata missing, bad magic, unsupported ABI version or bad struct size."""

    reason = "abi"


class ExpertMetadataError(ExpertRejected):
    """Metadata readable but inconsistent with the model (hidden size, layers) or itself."""

    reason = "metadata"


class ModelMismatch(ExpertMetadataError):
    """An expert built for another model (its base_model is not this model's fingerprint)."""

    reason = "base-model"


class ExpertSecurityError(ExpertRejected):
    """Symlink, group/world-writable file or folder, foreign owner, allowlist miss."""

    reason = "security"


class ExpertProbeError(HotplugError, RuntimeError):
    """The out-of-process probe refused the expert (crash, hang, NaN, nonzero return...)."""

    reason = "probe"


# ----------------------------------------------------------------------------- runtime

class ExpertForwardError(HotplugError, RuntimeError):
    """ffn_forward returned nonzero, or was called with bad arrays."""

    reason = "forward"


class ExpertCrashed(ExpertForwardError):
    """The isolated helper process of an expert died or stopped answering: it is disabled."""

    reason = "crashed"


class ExpertReleased(ExpertForwardError):
    """forward() called on an expert that the engine already released."""

    reason = "released"


class ExpertBuildError(HotplugError, RuntimeError):
    """`colibri expert build` failed: bad .npz contents or a compiler error."""

    reason = "build"


class RollbackError(HotplugError, ValueError):
    """rollback() asked for an expert that is not active or has no previous version."""

    reason = "rollback"
    http_status = 409
    error_type = "invalid_request_error"


class HotplugStateError(HotplugError, ValueError):
    """The state file or staging folder is unusable."""

    reason = "state"
