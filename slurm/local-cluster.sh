#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one machine, for tests and for trying llmd's launchers:
# slurmctld, four slurmd daemons emulating node[1-4] on 127.0.0.1, slurmdbd + a private MariaDB for sacct.
#
#   slurm/local-cluster.sh start    # install Debian packages if missing, write configs, start, wait until ready
#   slurm/local-cluster.sh status   # what runs and what sinfo says
#   slurm/local-cluster.sh stop     # stop every daemon this script started (by pid file)
#
# Needs root on Debian 12 (apt-get). State, logs and the database live under $LLMD_SLURM_DIR (/var/tmp/llmd-slurm);
# /etc/slurm/slurm.conf is written so plain sbatch/squeue and submitit find the cluster. Idempotent: a second start
# only starts what is not running.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin" # the daemons live in sbin, which a non-login shell may not have

DIR=${LLMD_SLURM_DIR:-/var/tmp/llmd-slurm}
NODES=(node1 node2 node3 node4)
CPUS_PER_NODE=${LLMD_SLURM_CPUS:-8}
CTLD_PORT=16817
DBD_PORT=16819
DB_PORT=16306
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
HOST=$(hostname -s)

say() { echo "local-cluster: $*"; }
die() {
    echo "local-cluster: ERROR: $*" >&2
    exit 1
}

alive() { # alive PIDFILE: the process named in PIDFILE runs
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_for() { # wait_for SECONDS WHAT CMD...: run CMD every second until it succeeds
    local limit=$1 what=$2
    shift 2
    for ((i = 0; i < limit; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    return 1
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v mariadbd >/dev/null || missing+=(mariadb-server)
    if ((${#missing[@]} == 0)); then return 0; fi
    [[ $(id -u) == 0 ]] || die "Slurm is not installed (${missing[*]} missing) and only root can install it: run as root"
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get: install Slurm 22.05 by hand"
    say "installing ${missing[*]} (apt-get, about a minute)"
    # Debian's package scripts would start the daemons with their stock configs; policy-rc.d 101 forbids that.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >"$DIR/log/apt.log" 2>&1 || die "apt-get update failed; see $DIR/log/apt.log"
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client slurmdbd mariadb-server \
        >>"$DIR/log/apt.log" 2>&1 || die "apt-get install failed; see $DIR/log/apt.log"
    if ((made_policy)); then rm -f "$policy"; fi
}

write_configs() {
    mkdir -p /etc/slurm "$DIR"/{state,run,log,spool,mysql}
    local nodelist="node[1-${#NODES[@]}]"
    cat >"$CONF" <<EOF
# Written by llmd slurm/local-cluster.sh: ${#NODES[@]} emulated nodes on this host (one slurmd -N each).
ClusterName=llmd
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# Requeued jobs restart after cred_expire; the default 120 s makes requeue tests crawl.
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=bf_interval=1,bf_resolution=1,bf_continue,bf_hetjob_immediate,sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
MinJobAge=600
InactiveLimit=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$nodelist NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-1700${#NODES[@]}] CPUs=$CPUS_PER_NODE RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$DBD_CONF" <<EOF
# Written by llmd slurm/local-cluster.sh
AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=llmd
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DBD_CONF"
}

start_mariadb() {
    local pidfile=$DIR/run/mariadb.pid sock=$DIR/run/mysqld.sock
    if ! alive "$pidfile"; then
        if [[ ! -d $DIR/mysql/mysql ]]; then
            say "initialising MariaDB in $DIR/mysql"
            mariadb-install-db --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
                >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install.log"
        fi
        say "starting MariaDB on 127.0.0.1:$DB_PORT"
        # setsid: its own session, so the caller's process group ending (a shell job, a make run) leaves it running.
        setsid nohup mariadbd --user=root --datadir="$DIR/mysql" --socket="$sock" --pid-file="$pidfile" \
            --port=$DB_PORT --bind-address=127.0.0.1 --log-error="$DIR/log/mariadb.log" \
            --innodb-buffer-pool-size=32M >/dev/null 2>&1 &
        wait_for 60 mariadb mariadb --socket="$sock" -e "SELECT 1" ||
            die "MariaDB did not answer within 60 s; see $DIR/log/mariadb.log"
    fi
    mariadb --socket="$sock" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'llmd';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'llmd';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
        die "could not create the slurm database user"
}

start_slurmdbd() {
    if ! alive "$DIR/run/slurmdbd.pid"; then
        say "starting slurmdbd on 127.0.0.1:$DBD_PORT"
        slurmdbd || die "slurmdbd did not start; see $DIR/log/slurmdbd.log"
    fi
    wait_for 60 slurmdbd sacctmgr -n list cluster || die "slurmdbd did not answer within 60 s; see $DIR/log/slurmdbd.log"
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx llmd; then
        sacctmgr -i add cluster llmd >/dev/null || die "sacctmgr could not register cluster llmd"
    fi
}

start_slurm() {
    if ! alive "$DIR/run/slurmctld.pid"; then
        say "starting slurmctld on 127.0.0.1:$CTLD_PORT"
        slurmctld || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    fi
    wait_for 30 slurmctld scontrol ping || die "slurmctld did not answer within 30 s; see $DIR/log/slurmctld.log"
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/spool/$node"
        if ! alive "$DIR/run/slurmd-$node.pid"; then
            say "starting slurmd -N $node"
            slurmd -N "$node" || die "slurmd $node did not start; see $DIR/log/slurmd-$node.log"
        fi
    done
}

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    local idle
    idle=$(grep -cE ' (idle|mixed|allocated)$' <<<"$states" || true)
    [[ $idle -ge ${#NODES[@]} ]]
}

start() {
    mkdir -p "$DIR/log"
    install_packages
    write_configs
    start_mariadb
    start_slurmdbd
    start_slurm
    if ! wait_for 30 nodes nodes_idle; then
        # A node drained or down from an earlier run (e.g. killed mid-job) comes back when told to resume.
        scontrol update nodename="node[1-${#NODES[@]}]" state=resume >/dev/null 2>&1 || true
        wait_for 30 nodes nodes_idle || {
            sinfo -N >&2 || true
            die "nodes are not idle after 60 s; see $DIR/log/slurmd-*.log and $DIR/log/slurmctld.log"
        }
    fi
    wait_for 30 sacct sacct -n -X -S now-1hours || die "sacct does not answer; see $DIR/log/slurmdbd.log"
    say "ready: $(sinfo -h -o '%D nodes %T' | tr '\n' ' ')(partition debug, sacct works, logs in $DIR/log)"
}

stop_pidfile() { # stop_pidfile NAME PIDFILE
    local pidfile=$2
    if alive "$pidfile"; then
        local pid
        pid=$(cat "$pidfile")
        say "stopping $1 (pid $pid)"
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 20; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

stop() {
    # Jobs first, so no step outlives its slurmd.
    if alive "$DIR/run/slurmctld.pid"; then scancel --full --quiet --user=root 2>/dev/null || true; fi
    for node in "${NODES[@]}"; do stop_pidfile "slurmd $node" "$DIR/run/slurmd-$node.pid"; done
    stop_pidfile slurmctld "$DIR/run/slurmctld.pid"
    stop_pidfile slurmdbd "$DIR/run/slurmdbd.pid"
    stop_pidfile mariadb "$DIR/run/mariadb.pid"
    say "stopped"
}

status() {
    local rc=0
    for pair in mariadb:mariadb.pid slurmdbd:slurmdbd.pid slurmctld:slurmctld.pid \
        $(for n in "${NODES[@]}"; do echo "slurmd-$n:slurmd-$n.pid"; done); do
        if alive "$DIR/run/${pair#*:}"; then echo "${pair%%:*}: running (pid $(cat "$DIR/run/${pair#*:}"))"; else
            echo "${pair%%:*}: stopped"
            rc=1
        fi
    done
    sinfo -N 2>/dev/null || rc=1
    return $rc
}

case ${1:-} in
start) start ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
