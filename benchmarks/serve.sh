# Sourced by the benchmark scripts: start and stop one `sluice serve`.
# Needs $sluice (the command), $port and $out (where the server's log goes) set by the caller.

serve() {  # serve MODELS_DIR [LOG_NAME]: start a server and wait until it is ready
  local log="$out/${2:-server}.log"
  $sluice serve --port "$port" --models "$1" > "$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/v2/health/ready" > /dev/null && return 0
    sleep 0.2
  done
  echo "server did not start" >&2; cat "$log" >&2; exit 1
}
stop() { kill -TERM "$server_pid"; wait "$server_pid" || true; }
