# Sourced by scripts/bootstrap.sh and scripts/sglang_env.sh: `pip_retry PYTHON LOG ARGS...` runs
# `PYTHON -m pip install ARGS...`, appending its output to LOG, and tries again (3 tries in all)
# when pip failed on the network: a CI run here ended after pip gave up on a torch wheel it had
# received 466.6 of 526.6 MB of (incomplete-download). A resolution or build error fails at once,
# as before: retrying it would only print the same error three times.
# pip's own patience is raised too, through its environment (older pips ignore names they lack).
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20} PIP_RETRIES=${PIP_RETRIES:-10} PIP_TIMEOUT=${PIP_TIMEOUT:-60}

# what pip prints when the network, not the request, failed
PIP_NETWORK_ERRORS='incomplete-download|Connection (interrupted|reset|aborted|refused)|ReadTimeoutError|ConnectTimeoutError|ProtocolError|IncompleteRead|Max retries exceeded|Temporary failure in name resolution|HTTP error 5[0-9][0-9]|THESE PACKAGES DO NOT MATCH THE HASHES'

pip_retry() {
  local python=$1 log=$2 try mark
  shift 2
  for try in 1 2 3; do
    mark=$(wc -l <"$log" 2>/dev/null || echo 0)
    "$python" -m pip install "$@" >>"$log" 2>&1 && return 0
    # only this try's output decides whether it was the network
    tail -n +"$((mark + 1))" "$log" | grep -Eq "$PIP_NETWORK_ERRORS" || return 1
    [ "$try" = 3 ] && return 1
    echo "pip: the network failed (try $try of 3; $log), trying again in $((try * ${PIP_RETRY_PAUSE_S:-15})) s" >&2
    sleep $((try * ${PIP_RETRY_PAUSE_S:-15}))
  done
}
