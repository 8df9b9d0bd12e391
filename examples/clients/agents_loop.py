"""An agent loop from the OpenAI Agents SDK against `tokenloom serve`, with no change to the
library: its chat-completions model, one function tool, the SDK's own runner (call, run the
tool, hand the result back, answer).

    pip install openai-agents          # tried with 0.24.0, in a virtual environment of its own
    tokenloom serve                    # OpenAI API on http://127.0.0.1:8000/v1
    python examples/clients/agents_loop.py --base-url http://127.0.0.1:8000/v1

The embedded 135M model calls the tool reliably only when the grammar makes it
(`tool_choice="required"`; the SDK resets it after the first call so the loop can end).
"""

import argparse
import asyncio

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    return f"18 degrees and sunny in {city}"


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    client = AsyncOpenAI(base_url=args.base_url, api_key="none")
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=args.model, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required"),
                  reset_tool_choice=True)
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    for item in result.new_items:
        print(type(item).__name__, getattr(item, "raw_item", ""))
    print("final:", result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
