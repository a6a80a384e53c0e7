"""Exception families of qnn_mutbuf.

One type per family, so that callers (and the CLI) can tell a missing SDK from a
model we cannot handle from a phone that went away. Every message names the node,
file or setting involved and says what to do about it.
"""


class QnnMutbufError(RuntimeError):
    """Base of every error qnn_mutbuf raises on purpose."""


class SdkNotFoundError(QnnMutbufError):
    """The QNN host libraries cannot be found, built or loaded."""


class UnsupportedMutationError(QnnMutbufError):
    """A buffer is mutated in a way qnn_mutbuf cannot lower faithfully."""


class LoweringError(QnnMutbufError):
    """Lowering to the QNN backend failed or was asked for something invalid."""


class InputError(QnnMutbufError, ValueError):
    """Inputs given to a runner do not match the program."""


class DeviceError(QnnMutbufError):
    """adb is missing, the phone is missing, or the program failed on it."""


class AiHubError(QnnMutbufError):
    """Qualcomm AI Hub is not configured or a job failed."""


class GateMissedError(QnnMutbufError):
    """The program ran, but its numbers missed a gate (--fail-below-sqnr, --max-steps-off)."""
