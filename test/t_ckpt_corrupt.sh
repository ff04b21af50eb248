#!/usr/bin/env bash
# Damaged checkpoints: a flipped byte, a truncated tensor file, a missing
# manifest, a wrong format version, a damaged manifest. Each is detected and
# named: `--resume DIR` exits 2; `--resume auto` skips it with a warning naming
# it and resumes from the previous one, still ending bit-identical.
set -u
cd "$(dirname "$0")/.."
T=${KILN_TEST_TMP:-$(mktemp -d)}/t_ckpt_corrupt
rm -rf "$T"
. test/ckpt_lib.sh
ckpt_setup
Y=$T/tiny.yaml

./train $Y --set run.dir=$T/ref >/dev/null 2>&1
REF=$(sums $T/ref/checkpoints/step_00000020)
# Checkpoints at 5, 10, 15 as if the run died before step 20: resuming after
# losing step 15 must pass through 10 -> 20 and still match the reference.
mkdir -p $T/base && cp -r $T/ref/checkpoints $T/ref/config.yaml $T/base/ && rm -rf $T/base/checkpoints/step_00000020
expect ckpt_info_verifies 0 '^verified' -- ./train ckpt-info $T/base/checkpoints/step_00000015

flip() { python3 - "$1" "$2" <<'PY'
import sys
p, off = sys.argv[1], int(sys.argv[2])
b = bytearray(open(p, "rb").read()); b[off] ^= 0x40; open(p, "wb").write(b)
PY
}
for kind in flip truncate no_manifest version manifest_edit zstd_flip; do
    D=$T/$kind
    rm -rf $D && mkdir -p $D
    if [ $kind = zstd_flip ]; then
        ./train $Y --set run.dir=$D --set checkpoint.compress=3 >/dev/null 2>&1 && rm -rf $D/checkpoints/step_00000020
    else
        cp -r $T/base/checkpoints $T/base/config.yaml $D/
    fi
    C=$D/checkpoints/step_00000015
    case $kind in
    flip|zstd_flip) flip $C/rank00000.bin 2000; pat="step_00000015.*(checksum mismatch|corrupt zstd)" ;;
    truncate) truncate -s -100 $C/rank00000.bin; pat="step_00000015.*truncated" ;;
    no_manifest) rm $C/manifest; pat="step_00000015.*(no manifest|cannot read the manifest)" ;;
    version) sed -i '1s/.*/kiln-checkpoint 99/' $C/manifest; pat="step_00000015.*format version 99" ;;
    manifest_edit) sed -i 's/^step 15$/step 16/' $C/manifest; pat="step_00000015.*manifest checksum mismatch" ;;
    esac
    expect ckpt_corrupt_${kind}_dir 2 "$pat" -- ./train $Y --set run.dir=$D --resume $C
    extra=""; [ $kind = zstd_flip ] && extra="--set checkpoint.compress=3"
    ./train $Y --set run.dir=$D $extra --resume auto >$T/auto.txt 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -qE "warning: --resume auto: skipping .*$pat" $T/auto.txt \
        && grep -q 'resumed from .*step_00000010 at step 10' $T/auto.txt && [ "$(sums $D/checkpoints/step_00000020)" = "$REF" ]; then
        ok ckpt_corrupt_${kind}_auto_skips
    else fail ckpt_corrupt_${kind}_auto_skips "rc $rc; $(grep -E 'warning|error|resumed' $T/auto.txt | head -3)"; fi
done
expect ckpt_info_names_damage 2 "entry 'wte': checksum mismatch" -- \
    bash -c "cp -r $T/base/checkpoints/step_00000005 $T/dmg && python3 -c \"
p='$T/dmg/rank00000.bin'; b=bytearray(open(p,'rb').read()); b[10]^=1; open(p,'wb').write(b)\" && ./train ckpt-info $T/dmg"
