#!/usr/bin/env bash
# make sanitize, after the build: the fast part of the suite (config, data,
# tokenizer, checkpoints and hostile checkpoints, metrics, ops and the model
# against its references, short training runs, resume, 2-rank MPI runs) with
# build-san/train and build-san/test/* in place of ./train and build/test/*.
# The tests run unchanged in build-san/tree/, a tree of links to this one whose
# train and build/ are the sanitized ones. Each sanitizer writes its reports to
# files (log_path): a test that expects a failing exit code cannot hide one, and
# any report of any process fails the run. docs/testing.md, "Sanitizers".
set -u
cd "$(dirname "$0")/.."
S=$PWD/build-san
[ -x $S/train ] || { echo "FAIL sanitize: $S/train not built (make sanitize builds it)"; exit 1; }
tree=$S/tree
rm -rf $tree $S/logs && mkdir -p $tree $S/logs
for f in *; do
    case $f in build|build-san|build-fuzz|train) continue ;; esac
    ln -s ../../$f $tree/$f
done
ln -s .. $tree/build
ln -s ../train $tree/train
# detect_leaks: LeakSanitizer at every exit; its suppressions say why each is
# there. abort_on_error=0 / exitcode: the reports, not the exit codes, decide.
export ASAN_OPTIONS="log_path=$S/logs/asan:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:allocator_may_return_null=0:fast_unwind_on_malloc=0:malloc_context_size=40"
export LSAN_OPTIONS="suppressions=$PWD/test/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="log_path=$S/logs/ubsan:print_stacktrace=1:halt_on_error=1"
export KILN_TESTS="${KILN_SAN_TESTS:-test_config test_data test_tokenizer test_ckpt test_ckpt_hostile test_metrics \
test_safetensors test_optim test_comm test_flight test_straggler test_ops test_model_ref test_model_arch_ref \
test_model_stages test_model_init test_rng t_train t_hostile t_ckpt_corrupt t_resume t_prepare t_tokenizer_tiktoken t_metrics t_mpi t_ckpt_mpi t_dp}"
(cd $tree && bash test/run.sh)
rc=$?
n=$(ls $S/logs | wc -l)
if [ "$n" -gt 0 ]; then
    for f in $S/logs/*; do
        echo "--- $f"
        grep -m 12 -E 'ERROR|SUMMARY|runtime error|#[0-9]+ ' "$f"
    done | head -n 200
    echo "FAIL sanitizer_reports: $n report file(s) in $S/logs"
    exit 1
fi
echo "ok sanitizer_reports: none"
exit $rc
