"""The official `openai` client, unchanged, against `tokenloom serve` (its `openai` frontend).

    tokenloom serve &                                   # OpenAI API on 127.0.0.1:8000
    python examples/clients/openai_client.py "What is the capital of France?"

`--base-url` points elsewhere; the API key comes from $TOKENLOOM_API_KEY when the server
has one (any string otherwise: the client insists on one).
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("question", nargs="?", default="What is the capital of France?")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("TOKENLOOM_API_KEY", "none"))
    model = client.models.list().data[0].id
    print(f"model: {model}")

    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=args.max_tokens,
                                           messages=[{"role": "user", "content": args.question}])
    print(f"whole:     {reply.choices[0].message.content!r} ({reply.usage.completion_tokens} tokens, "
          f"finish {reply.choices[0].finish_reason})")

    print("streamed:  ", end="", flush=True)
    stream = client.chat.completions.create(model=model, temperature=0, max_tokens=args.max_tokens, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": args.question}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens, "
                  f"{chunk.usage.prompt_tokens_details.cached_tokens} prompt tokens from the prefix cache]")


if __name__ == "__main__":
    main()
