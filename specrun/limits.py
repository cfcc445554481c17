"""Limits llama.cpp sets that shape every layer above it."""

# llama.cpp keeps at most this many sequences in one context (LLAMA_MAX_SEQ). A draft tree is
# scored in one batch with one sequence id per leaf ("colour"), so it is also the most leaves a
# tree can have, and the most tree nodes a drafter can expand into sequences of their own.
MAX_SEQ = 256

# llama.cpp's RPC worker listens on this port unless told otherwise (tools/rpc/rpc-server.cpp).
RPC_DEFAULT_PORT = 50052
