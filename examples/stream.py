"""Stream a chat answer from the default model, token by token, inside asyncio."""

from __future__ import annotations

import asyncio

from inlinelm import Engine


async def main() -> None:
    async with Engine(model="default") as engine:
        messages = [{"role": "user", "content": "Write a haiku about the sea."}]
        async for out in engine.chat(messages, temperature=0.0, max_tokens=64):
            print(out.text, end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main())
