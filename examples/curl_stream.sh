#!/usr/bin/env bash
# Stream a chat reply from a running pagedserve (or any OpenAI-compatible server) with curl.
#   pagedserve serve &            # in another terminal
#   examples/curl_stream.sh "Why is the sky blue?"
set -euo pipefail
BASE_URL="${BASE_URL:-http://127.0.0.1:8000/v1}"
PROMPT="${1:-Write a haiku about the sea.}"
MAX_TOKENS="${MAX_TOKENS:-64}"
BODY=$(python3 -c 'import json, sys; print(json.dumps({"messages": [{"role": "user", "content": sys.argv[1]}],
  "stream": True, "max_tokens": int(sys.argv[2]), "stream_options": {"include_usage": True}}))' "$PROMPT" "$MAX_TOKENS")
curl -sS -N --fail-with-body "$BASE_URL/chat/completions" -H "Content-Type: application/json" -d "$BODY"
