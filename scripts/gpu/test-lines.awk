# `cargo test -- --nocapture` output as one line per test for the GPU logs: ok, FAIL, or skip
# with the reason the test printed (a test that returns early because the machine lacks
# something passes as far as cargo is concerned; the log must not call it ok).
/^test .* \.\.\. / {
    name = $0; sub(/^test /, "", name); sub(/ \.\.\. .*$/, "", name)
    rest = $0; sub(/^test .* \.\.\. /, "", rest)
    if (rest == "ok") { print "ok   NCCL " name; name = ""; next }
    if (rest == "FAILED") { print "FAIL NCCL " name; name = ""; next }
    why = rest; next
}
name != "" && /^ok$/ { if (why ~ /skipped/) print "skip NCCL " name ": " why; else print "ok   NCCL " name; name = ""; why = ""; next }
name != "" && /^FAILED$/ { print "FAIL NCCL " name; name = ""; why = ""; next }
{ print }
