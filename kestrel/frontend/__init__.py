"""The process boundary: the asyncio front door, the engine process (or thread) behind pipes, text assembly."""
