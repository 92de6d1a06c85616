"""The batch tier: OpenAI's files and batches API, run on the fleet's spare room.

- `store`: where files, batches and results live (a local directory, or Redis);
- `api`: the HTTP endpoints (/v1/files, /v1/batches);
- `runner`: the background task that runs batch items while a pool has room to spare.
"""
