"""Exit codes and the domain exceptions that map onto them.

Every failure a user can cause or meet is a KvctlError: the CLI prints its message and hint as
one line each on stderr and exits with its code; only --debug shows a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """kvctl's exit codes; scripts may rely on them."""

    OK = 0
    ERROR = 1
    USAGE = 2
    UNREACHABLE = 3
    REJECTED = 4
    SERVER_ERROR = 5
    PARTIAL = 6
    INTERRUPTED = 130


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "ok",
    ExitCode.ERROR: "error (bad input, failed check)",
    ExitCode.USAGE: "usage error (unknown option, bad value)",
    ExitCode.UNREACHABLE: "server unreachable or timed out",
    ExitCode.REJECTED: "rejected by the server (4xx)",
    ExitCode.SERVER_ERROR: "server error (5xx)",
    ExitCode.PARTIAL: "partial success (some targets failed)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


class KvctlError(Exception):
    """A failure with a message for the user, a hint with the next step, and an exit code."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(KvctlError):
    """The command line itself is wrong (a value that does not parse, flags that conflict)."""

    exit_code = ExitCode.USAGE


class UnreachableError(KvctlError):
    """A server did not answer: connection refused, timeout, socket missing."""

    exit_code = ExitCode.UNREACHABLE


class RejectedError(KvctlError):
    """A server answered with a client error (4xx) or refused the operation."""

    exit_code = ExitCode.REJECTED


class RoutesAbsent(RejectedError):
    """The server is LMCache's without kvctl's routes (a stock engine or MP server): what needs them
    cannot be done there; what LMCache's own routes serve still can."""


def tier_error(error: KvctlError) -> str:
    """What one tier's entry in a report's `errors` says: the message, and for a missing route also
    the one line that adds it (a per-tier entry has no hint of its own)."""
    return f"{error.message}; {error.hint}" if isinstance(error, RoutesAbsent) and error.hint else error.message


class ServerError(KvctlError):
    """A server answered with a server error (5xx)."""

    exit_code = ExitCode.SERVER_ERROR
