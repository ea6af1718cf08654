#!/bin/sh
# HAProxy for Serve's HTTP front. cluster/api/serve_env.py points RAY_SERVE_HAPROXY_BINARY_PATH
# at this script and QWEN3_SERVE_HAPROXY_BINARY at the real binary; Serve runs it as
# `haproxy.sh -db -f <config> -dR [-sf <pids>]` right after writing <config> from its template
# (ray/serve/_private/haproxy_templates.py), which has no setting for what is changed here:
#  - the stats page and the Prometheus exporter listen on QWEN3_SERVE_HAPROXY_ADMIN_HOST
#    (127.0.0.1 unless set) instead of every interface, where anyone could read them; the
#    HTTP front keeps the manifest's http_options.host;
#  - the admin socket (`level admin`: it can take servers down) is 0600 instead of 0666;
#  - -dS: no splice(2). With the template's `option splice-request/-response`, a client that
#    closed its connection while the server was still working was at times not passed on to
#    the server, and HAProxy spun on the dead socket: the abandoned request ran to max_tokens.
# The file keeps its path, so Serve's bookkeeping (which finds its HAProxy processes by the
# config path on their command line) is unchanged.
set -eu
binary="${QWEN3_SERVE_HAPROXY_BINARY:?the HAProxy binary to run; set by cluster/api/serve_env.py}"
host="${QWEN3_SERVE_HAPROXY_ADMIN_HOST:-127.0.0.1}"
config=""
previous=""
for arg in "$@"; do
  if [ "$previous" = "-f" ]; then config="$arg"; fi
  previous="$arg"
done
if [ -n "$config" ]; then
  sed -i \
    -e "/^frontend prometheus\$/,/^[^ ]/ s/^\( *bind \)[^ ]*:\([0-9][0-9]*\)\$/\1$host:\2/" \
    -e "/^listen stats\$/,/^[^ ]/ s/^\( *bind \)[^ ]*:\([0-9][0-9]*\)\$/\1$host:\2/" \
    -e "s/^\( *stats socket .*\) mode 666 /\1 mode 600 /" \
    "$config"
fi
exec "$binary" -dS "$@"
