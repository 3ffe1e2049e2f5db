#!/usr/bin/env bash
# Make sure the local services the tests need are up; start the ones that are down.
# Usage: scripts/services.sh postgres [mariadb redis rabbitmq ...]
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  case "$1" in
    postgres) pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start ;;
    mariadb) start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd ;;
    redis) redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
             --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log ;;
    rabbitmq) rabbitmq-server -detached ;;
    *) echo "services.sh: unknown service $1" >&2; return 2 ;;
  esac
}

port_of() {
  case "$1" in
    postgres) echo 5432 ;; mariadb) echo 3306 ;; redis) echo 6379 ;; rabbitmq) echo 5672 ;;
  esac
}

for name in "$@"; do
  port=$(port_of "$name")
  port_open "$port" && continue
  echo "services.sh: $name is down on 127.0.0.1:$port, starting it"
  start "$name"
  for _ in $(seq 1 120); do
    port_open "$port" && break
    sleep 0.5
  done
  port_open "$port" || { echo "services.sh: $name did not come up on port $port" >&2; exit 1; }
done
