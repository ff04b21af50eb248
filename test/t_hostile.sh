#!/usr/bin/env bash
# Files a user did not mean to give, or someone else wrote (the fuzz and
# sanitizer findings of issue 21, end to end through ./train): a FIFO or a
# device where a file belongs, for every reader; a config too large or nested
# too deep (a file and --set); a checkpoint whose checksums are right but whose
# numbers are not a state (resume refuses it naming the entry, auto skips it);
# metrics whose axis spans a few ulps (./train report ends); --dry-run at the
# largest batch the config accepts. Every refusal is exit 2 with the file or
# key named; nothing hangs: each command runs under a 60 s timeout, so a hang
# reads as exit 124 and fails, without any check on time.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_hostile
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml
to() { timeout 60 "$@"; }
mkfifo $T/fifo
ln -s /dev/zero $T/zero.yaml

# ---- readers of files a user names
expect fifo_config 2 "fifo: cannot read config: not a regular file" -- to ./train $T/fifo
expect dev_zero_config 2 "zero.yaml: cannot read config: not a regular file" -- to ./train $T/zero.yaml
expect directory_config 2 "cannot read config: Is a directory" -- to ./train $T
head -c $((1048576 + 1)) /dev/zero | tr '\0' '#' > $T/big.yaml
expect config_over_1_mib 2 "big.yaml: cannot read config: larger than the 1048576 bytes" -- to ./train $T/big.yaml
{ printf 'model: {n_layer: '; head -c 200000 /dev/zero | tr '\0' '['; } > $T/deep.yaml
expect config_nested_200000 2 "deep.yaml:1: YAML nested deeper than 32 levels" -- to ./train $T/deep.yaml
expect set_nested_100000 2 "^kiln: error: --set: YAML nested deeper than 32 levels" -- \
    to ./train $Y --set "model.n_layer=$(head -c 100000 /dev/zero | tr '\0' '[')"
printf 'a\n' > $T/in.txt
expect prepare_fifo_input 2 "fifo: cannot read: not a regular file" -- \
    to ./train prepare --tokenizer byte --out $T/p $T/fifo
expect prepare_fifo_vocab 2 "gpt2 vocabulary '.*fifo': not a regular file" -- \
    to ./train prepare --tokenizer gpt2 --vocab $T/fifo --out $T/p $T/in.txt
expect run_fifo_tokenizer_file 2 "fifo': not a regular file" -- \
    to ./train $Y --set run.dir=$T/r0 --set data.tokenizer=gpt2 --set data.tokenizer_file=$T/fifo \
    --set model.vocab_size=50257
expect run_fifo_init_from 2 "fifo: cannot open llm.c checkpoint \(key 'init.from'\): not a regular file" -- \
    to ./train $Y --set run.dir=$T/r1 --set init.from=$T/fifo
expect run_fifo_shard 2 "fifo: not a regular file" -- to ./train $Y --set run.dir=$T/r2 --set "data.train=$T/fifo"

# ---- a run directory with FIFOs for its files: resume, status and report end
./train $Y --set run.dir=$T/run --set train.steps=10 >$T/run.txt 2>&1 || fail run_for_fifos "$(tail -3 $T/run.txt)"
cp -r $T/run $T/fr
rm $T/fr/checkpoints/latest && mkfifo $T/fr/checkpoints/latest
expect resume_auto_fifo_latest 0 "resumed from .*step_00000010 at step 10" -- \
    to ./train $Y --set run.dir=$T/fr --set train.steps=10 --resume auto
rm $T/fr/checkpoints/step_00000010/manifest && mkfifo $T/fr/checkpoints/step_00000010/manifest
expect resume_dir_fifo_manifest 2 "step_00000010/manifest: cannot read the manifest: not a regular file" -- \
    to ./train $Y --set run.dir=$T/fr --resume $T/fr/checkpoints/step_00000010
for f in heartbeat/rank0.json metrics.jsonl config.yaml; do
    rm $T/fr/$f && mkfifo $T/fr/$f
    name=$(basename $f .json | tr . _)
    to ./train status $T/fr >$T/st.txt 2>&1; rc=$?
    if [ $rc -eq 0 ] || [ $rc -eq 2 ]; then ok status_fifo_$name; else fail status_fifo_$name "exit $rc: $(tail -2 $T/st.txt)"; fi
    to ./train report $T/fr -o $T/fr.html >$T/rp.txt 2>&1; rc=$?
    if [ $rc -eq 0 ] || [ $rc -eq 2 ]; then ok report_fifo_$name; else fail report_fifo_$name "exit $rc: $(tail -2 $T/rp.txt)"; fi
done

# ---- ./train report: an axis spanning a few ulps has ticks that never
# advanced by adding the step; the page must come out with its charts
mkdir -p $T/ulp $T/far
cp $T/run/config.yaml $T/ulp/ && cp $T/run/config.yaml $T/far/
for i in 1 2 3 4; do
    echo "{\"step\":$i,\"tokens\":$((i * 256)),\"loss\":2.5,\"lr\":0.1$([ $i -gt 2 ] && echo 0000000000000002),\"grad_norm\":1,\"tok_s\":1000,\"step_s\":0.1}"
done > $T/ulp/metrics.jsonl
# far: every step the largest a run can reach (INT_MAX), an axis of zero span far from 0
for i in 1 2 3; do
    echo "{\"step\":2147483647,\"tokens\":$i,\"loss\":$i,\"lr\":0.001,\"grad_norm\":1,\"tok_s\":1000,\"step_s\":0.1}"
done > $T/far/metrics.jsonl
for r in ulp far; do
    to ./train report $T/$r -o $T/$r.html >$T/rp.txt 2>&1; rc=$?
    if [ $rc -eq 0 ] && grep -q '<svg' $T/$r.html; then ok report_ticks_$r; else fail report_ticks_$r "exit $rc: $(tail -2 $T/rp.txt)"; fi
done
# a step past any run's (1e17) is refused naming the file, line and key, not read as a number
mkdir -p $T/past && cp $T/run/config.yaml $T/past/ && sed 's/2147483647/1e17/' $T/far/metrics.jsonl > $T/past/metrics.jsonl
expect report_step_past_int 2 "past/metrics.jsonl:1: key 'step': expected a whole number from 0 to 2147483647, got 1e\+17" -- \
    to ./train report $T/past -o $T/past.html

# ---- one metrics.jsonl line of 100 MB (a string, the digits of a number,
# blanks where a value belongs, 9 million val/ keys, or still being written:
# no newline), and a flight dump with a 100 MB record or header line: status,
# report, compare and doctor end as for any run, or exit 2 naming the file;
# peak memory (rusage of the child) stays within 3x the file over what the
# same command takes on the plain run. 100,000 ordinary lines under the 60 s
# timeout: each line's search for a key it lacks once ran on through the
# rest of the file (20,000 lines: 7 s in status; 100,000: minutes).
rss() { /usr/bin/python3 -c 'import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], "w")).returncode
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)' "$@"; }
mkdir -p $T/huge/flight
cp $T/run/config.yaml $T/huge/
M=$((100 * 1024 * 1024))
read -r _ base < <(rss $T/base.err ./train status $T/run)
plain=$(head -2 $T/run/metrics.jsonl)
for kind in string digits blanks keys torn; do
    { echo "$plain"; case $kind in
        string) printf '{"step":3,"loss":2.4,"note":"'; head -c $M /dev/zero | tr '\0' x; echo '"}' ;;
        digits) printf '{"step":3,"loss":2.'; head -c $M /dev/zero | tr '\0' 7; echo '}' ;;
        blanks) printf '{"step":3,"loss":'; head -c $M /dev/zero | tr '\0' ' '; echo '}' ;;
        keys) /usr/bin/python3 -c 'import sys; sys.stdout.write("{\"step\":3," + ",".join("\"val/k%d\":1" % i for i in range(9000000)) + "}\n")' ;;
        torn) printf '{"step":3,"loss":2.4,"note":"'; head -c $M /dev/zero | tr '\0' x ;;
    esac; } > $T/huge/metrics.jsonl
    size=$(stat -c %s $T/huge/metrics.jsonl)
    for c in status report compare; do
        case $c in
            status) args=(status $T/huge) ;; report) args=(report $T/huge -o $T/huge.html) ;; compare) args=(compare $T/huge $T/run) ;;
        esac
        read -r rc peak < <(rss $T/huge.err timeout 60 ./train "${args[@]}")
        lines=$(grep -c . $T/huge.err)
        if { [ "$rc" = 0 ] || { [ "$rc" = 2 ] && [ "$lines" = 1 ] && grep -q 'huge/metrics.jsonl' $T/huge.err; }; } &&
            [ $((peak - base)) -lt $((3 * size / 1024)) ]; then ok ${c}_metrics_line_100mb_$kind
        else fail ${c}_metrics_line_100mb_$kind "exit $rc, peak $peak KB (plain run $base KB): $(tail -c 300 $T/huge.err)"; fi
    done
done
hdr='{"format":"kiln-flight","version":1,"rank":0,"world":1,"host":"vm","pid":1,"reason":"timeout","detail":-1,"time":1796614903.2,"step":4,"phase":"backward","capacity":256,"recorded":1,"waiting":288,"ops":['
rec='{"id":288,"group":"dp","group_first":0,"group_size":1,"op":"all_reduce","seq":6,"coll":1,"dtype":"f32","count":4096,"peer":-1,"step":4,"phase":"backward","posted":1796614899.5,"started":1796614899.6,"completed":null,"state":"started"}'
for kind in record header; do
    { case $kind in
        record) echo "$hdr"; printf '{"id":288,"group":"dp","op":"all_reduce","posted":1.5,"note":"'
                head -c $M /dev/zero | tr '\0' x; echo '"}' ;;
        header) printf '{"format":"kiln-flight","version":1,"rank":0,"host":"'; head -c $M /dev/zero | tr '\0' x
                echo '","ops":['; echo "$rec" ;;
    esac; echo ']}'; } > $T/huge/flight/rank0.json
    read -r rc peak < <(rss $T/huge.err timeout 60 ./train doctor $T/huge)
    if { [ "$rc" = 0 ] || [ "$rc" = 3 ] || { [ "$rc" = 2 ] && [ "$(grep -c . $T/huge.err)" = 1 ]; }; } &&
        [ $((peak - base)) -lt $((3 * M / 1024)) ]; then ok doctor_flight_line_100mb_$kind
    else fail doctor_flight_line_100mb_$kind "exit $rc, peak $peak KB (plain run $base KB): $(tail -c 300 $T/huge.err)"; fi
done
rm -rf $T/huge
mkdir -p $T/long && cp $T/run/config.yaml $T/long/
/usr/bin/python3 -c 'import sys
for i in range(100000): sys.stdout.write("{\"step\":%d,\"tokens\":%d,\"loss\":2.5,\"lr\":0.001,\"grad_norm\":1,\"tok_per_s\":1000,\"step_time_s\":0.1}\n" % (i, 256 * i))' > $T/long/metrics.jsonl
expect status_metrics_100k_lines 0 "last step +99999" -- to ./train status $T/long
expect report_metrics_100k_lines 0 "report: .*long.html" -- to ./train report $T/long -o $T/long.html
# ranks.jsonl: a last line of 20 million ranks once asked for 40 GB (exit 1, out of memory)
/usr/bin/python3 -c 'import sys; sys.stdout.write("{\"step\":1,\"busy_s\":[" + ",".join(["0.1"] * 20000000) + "],\"step_s\":[0.1]}\n")' > $T/long/ranks.jsonl
expect status_ranks_line_20m_ranks 2 "long/ranks.jsonl: key 'busy_s': more than 4194304 ranks on the last line" -- \
    to ./train status $T/long
rm -rf $T/long

# ---- --dry-run at batch.total_tokens = 2^62, the largest the config takes
expect dry_run_tokens_past_int64 0 "tokens in total +4.61e\+21 \(over 2\^63\)" -- \
    to ./train $Y --dry-run --set batch.total_tokens=4611686018427387904 --set batch.micro_batch=65536 \
    --set model.seq_len=65536 --set train.steps=1000

# ---- checkpoints whose checksums are right but whose numbers are no state:
# setblob DIR NAME STRUCT_FORMAT VALUE... rewrites one blob in place and
# reseals its crc32c and the manifest's end line
setblob() {
    python3 - "$@" <<'PY'
import struct, sys
d, name, fmt, vals = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
T = []
for i in range(256):
    c = i
    for _ in range(8): c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    T.append(c)
def crc(b):
    c = 0xffffffff
    for x in b: c = T[(c ^ x) & 0xff] ^ (c >> 8)
    return c ^ 0xffffffff
lines = open(d + "/manifest").read().split("\n")[:-2]  # the end line and the final ""
out = []
for l in lines:
    if l.startswith("entry name=%s " % name):
        f = dict(kv.split("=", 1) for kv in l.split()[1:])
        new = struct.pack("<" + fmt, *[float(v) if fmt[-1] == "d" else int(v) for v in vals])
        assert len(new) == int(f["bytes"]) and f["codec"] == "none", (len(new), f["bytes"])
        p = d + "/" + f["file"]
        b = bytearray(open(p, "rb").read()); o = int(f["offset"]); b[o:o + len(new)] = new
        open(p, "wb").write(b)
        l = l.replace("crc32c=" + f["crc32c"], "crc32c=%08x" % crc(new))
    out.append(l)
body = ("\n".join(out) + "\n").encode()
open(d + "/manifest", "wb").write(body + b"end crc32c=%08x\n" % crc(body))
PY
}
# cases: NAME ENTRY FORMAT VALUES... ; the run's checkpoints are at 5 and 10
bad_state() {
    local case=$1 entry=$2 fmt=$3; shift 3
    local D=$T/bad_$case
    rm -rf $D && cp -r $T/run $D
    setblob $D/checkpoints/step_00000010 $entry $fmt "$@"
    expect resume_dir_refuses_$case 2 "step_00000010: entry '$entry' " -- \
        to ./train $Y --set run.dir=$D --resume $D/checkpoints/step_00000010
    to ./train $Y --set run.dir=$D --set train.steps=12 --resume auto >$T/auto.txt 2>&1; local rc=$?
    if [ $rc -eq 0 ] && grep -q "skipping .*step_00000010: .*entry '$entry'" $T/auto.txt \
        && grep -q 'resumed from .*step_00000005 at step 5' $T/auto.txt; then ok resume_auto_skips_$case
    else fail resume_auto_skips_$case "exit $rc: $(grep -E 'warning|error|resumed' $T/auto.txt | head -3)"; fi
}
bad_state step_2_31 train.step q 2147483648
bad_state step_int64_max train.step q 9223372036854775807
bad_state step_negative train.step q -1
bad_state tokens_int64_max train.tokens q 9223372036854775807
bad_state optim_step_past_step optim.step q 11
bad_state elapsed_nan train.elapsed_s d nan
bad_state data_pos_past_2_62 data.train.pos QQ 4611686018427387905 0
# data.train.state (version, sources, g, g0, then 6 words a source): the blend beginning past the samples drawn
off=$(grep '^entry name=data.train.state ' $T/run/checkpoints/step_00000010/manifest | grep -o ' offset=[0-9]*' | cut -d= -f2)
state=$(python3 -c "
import struct; b=open('$T/run/checkpoints/step_00000010/rank00000.bin','rb').read()[$off:$off+80]
w=list(struct.unpack('<10Q', b)); w[3]=w[2]+1; print(' '.join(map(str, w)))")
bad_state data_state_blend_past_drawn data.train.state 10Q $state
