//! What a process costs, read from Linux's `/proc`: CPU time, resident memory, load average.
//! The benches, the soak and the hostile-feed test measure the router and agent with these.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("unreadable /proc/PID/stat line: {0}")]
pub struct ProcStatError(pub &'static str);

/// Linux reports utime and stime in USER_HZ ticks, 100 per second on every architecture's
/// userspace ABI.
const USER_HZ: f64 = 100.0;

/// A process's CPU time (utime + stime, all threads, in seconds) from its `/proc/PID/stat`
/// line. The command name is in parentheses and may itself hold spaces or parentheses, so the
/// fields are counted from the last `)`.
pub fn proc_stat_cpu_seconds(stat: &str) -> Result<f64, ProcStatError> {
    let (_, after_name) = stat
        .rsplit_once(')')
        .ok_or(ProcStatError("no command name"))?;
    // After the name: state (field 3) … utime is field 14, stime field 15.
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let tick = |index: usize| -> Result<u64, ProcStatError> {
        fields
            .get(index)
            .ok_or(ProcStatError("too few fields"))?
            .parse::<u64>()
            .map_err(|_| ProcStatError("utime or stime is not a number"))
    };
    Ok((tick(11)? + tick(12)?) as f64 / USER_HZ)
}

/// (VmRSS, VmHWM) in MiB from a `/proc/PID/status` text (0 where absent).
pub fn parse_status_rss_mib(status: &str) -> (f64, f64) {
    let kib = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
}

/// `/proc/loadavg`'s three averages.
pub fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cpu_time_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (vllm (router) x) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 37 0 0 20 0 \
                    9 0 123456 1000000 2000 18446744073709551615";
        assert_eq!(proc_stat_cpu_seconds(stat), Ok(2.87));
        assert!(proc_stat_cpu_seconds("4242 no name").is_err());
        assert!(proc_stat_cpu_seconds("1 (x) S 1 2").is_err());
    }

    #[test]
    fn status_rss_parses() {
        let status = "Name:\tllmgw-router\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\n";
        assert_eq!(parse_status_rss_mib(status), (10.0, 20.0));
    }
}
