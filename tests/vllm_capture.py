"""Output captured from a real vLLM 0.32 server, kept in tests/fixtures/ (see its header)."""

from __future__ import annotations

from pathlib import Path

CHAT = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32-chat.txt"


def section(number: str) -> list[str]:
    """The lines of the capture's section `## <number>.`, without its title."""
    lines: list[str] = []
    inside = False
    for line in CHAT.read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith(f"## {number}.")
        elif inside:
            lines.append(line)
    return lines


def sse(number: str) -> bytes:
    """The server-sent events of a streamed section, as the server wrote them."""
    return b"".join(
        line.encode() + b"\n\n" for line in section(number) if line.startswith("data: ")
    )
