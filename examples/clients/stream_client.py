"""Stream two questions at once over one WebSocket connection.

    tokenloom serve &                       # in one terminal
    python examples/clients/stream_client.py "What is the capital of France?" "Name a planet."
"""

from __future__ import annotations

import asyncio
import sys

from tokenloom.protocols.websocket.client import Client
from tokenloom.protocols.websocket.messages import Delta, Done


async def ask(client: Client, question: str) -> str:
    parts = []
    async for event in client.generate(messages=[{"role": "user", "content": question}],
                                       params={"temperature": 0, "max_tokens": 128}):
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Done):
            parts.append(f"  [{event.finish_reason}, TTFT {event.metrics.ttft_ms:.0f} ms]")
    return "".join(parts)


async def main(url: str, questions: list[str]) -> None:
    async with Client(url) as client:
        print(f"model: {client.session.model}")
        answers = await asyncio.gather(*(ask(client, q) for q in questions))
        for q, a in zip(questions, answers, strict=True):
            print(f"> {q}\n{a}\n")


if __name__ == "__main__":
    asyncio.run(main("ws://127.0.0.1:8765", sys.argv[1:] or ["What is the capital of France?"]))
