/* fuzz_ckptlayout: resuming a checkpoint that a tensor-, pipeline-, context-
 * or expert-parallel run wrote (one manifest, a rank file per writer) onto
 * one rank of some layout, the reshard path of --resume DIR and init.from
 * (resume.c resume_load: the saved config against this run's, ckpt_load of
 * this rank's table, data.train.state; state.c state_init_from). The model is
 * the seeds' (a two-layer MoE llama, Lion), built for the loading rank with
 * the same options train.c gives model_init, and its table is what state.c
 * asks for: every parameter (tensor-parallel boxes, a stage's layers, an
 * expert rank's experts), optim.m over the rank's optimizer range, the blobs.
 * The input:
 *   LAYOUT  first byte: the loading rank (layouts[] below, by value mod its size)
 *   HOW     second byte: 'r' --resume DIR, 'f' the same with --force, 'i'
 *           init.from (else by value mod 3)
 *   \n@@@NAME\nBYTES  the checkpoints folder's files (fuzz.h, fuzz_unpack):
 *           step_00000002/ is the one --resume DIR names; `latest` and
 *           other step_N/ beside it are what --resume auto then chooses from
 * step_00000002's manifest's "end crc32c=" line is resealed, as someone who edits a
 * manifest would, so that what follows it is parsed rather than refused as
 * damage. Runs in a child: both paths exit 2 on a checkpoint they refuse.
 * KILN_FUZZ_CKPTLAYOUT_SHOW=1 with one input runs it here. The seeds come
 * from real runs: test/fuzz/ckptlayout_seeds.sh. */
#include "arch.h"
#include "backend.h"
#include "ckpt.h"
#include "config.h"
#include "fuzz.h"
#include "model.h"
#include "optim.h"
#include "resume.h"
#include "state.h"

/* The seeds' model: test/fuzz/ckptlayout_seeds.sh trains it (keep the two in step). */
static const char *sets[] = {"model.arch=llama", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2",
                             "model.n_embd=8", "model.seq_len=8", "model.vocab_size=256",
                             "model.tie_embeddings=true", "model.mlp=moe", "model.moe.n_experts=2",
                             "model.moe.top_k=1", "model.moe.expert_hidden=8", "optim.name=lion",
                             "run.seed=7", "run.threads=1", "batch.micro_batch=2", "batch.total_tokens=64",
                             "data.train=/tmp/kiln-ckptlayout-seeds/data/train_*.bin",
                             "data.val=/tmp/kiln-ckptlayout-seeds/data/val_*.bin"};

/* The rank that loads: its place in each parallel group (0: not split), and
 * ZeRO-1's half of the optimizer state (zero_half 1: the second half). */
static const struct Layout {
    const char *name;
    int tp, tp_rank, pp, pp_rank, ep, ep_rank, cp, cp_rank, zero_half;
} layouts[] = {
    {"one rank", 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"tp 2 rank 0", 2, 0, 0, 0, 0, 0, 0, 0, 0},
    {"tp 2 rank 1", 2, 1, 0, 0, 0, 0, 0, 0, 0},
    {"pp 2 stage 0", 0, 0, 2, 0, 0, 0, 0, 0, 0},
    {"pp 2 stage 1", 0, 0, 2, 1, 0, 0, 0, 0, 0},
    {"ep 2 rank 0", 0, 0, 0, 0, 2, 0, 0, 0, 0},
    {"ep 2 rank 1", 0, 0, 0, 0, 2, 1, 0, 0, 0},
    {"cp 2 rank 1", 0, 0, 0, 0, 0, 0, 2, 1, 0},
    {"tp 2 rank 1, ep 2 rank 1", 2, 1, 0, 0, 2, 1, 0, 0, 0},
    {"pp 2 stage 1, tp 2 rank 1", 2, 1, 2, 1, 0, 0, 0, 0, 0},
    {"dp 2 ZeRO-1 rank 1", 0, 0, 0, 0, 0, 0, 0, 0, 1},
};
#define NLAYOUT ((int)(sizeof layouts / sizeof layouts[0]))

static Config cfg;
static ArchSpec spec;
static char *yaml; /* this run's resolved config, as state_open compares it */

FUZZ_NOCOV static void setup(void) {
    if (yaml) return;
    cfg_load(&cfg, NULL, sets, (int)(sizeof sets / sizeof sets[0]));
    arch_from_config(&cfg, &spec);
    yaml = cfg_yaml_text(&cfg, NULL);
}

/* The manifest resealed: its last "end " line dropped and the right one appended. */
FUZZ_NOCOV static void reseal(const char *dir) {
    char path[600];
    snprintf(path, sizeof path, "%s/manifest", dir);
    size_t len;
    char *t = fuzz_read_regular(path, &len);
    if (!t) return;
    size_t body = len;
    while (body > 0 && t[body - 1] == '\n') body--;
    while (body > 0 && t[body - 1] != '\n') body--;
    if (len - body >= 4 && !memcmp(t + body, "end ", 4)) len = body;
    char *m = xmalloc(len + 32);
    memcpy(m, t, len);
    if (len && m[len - 1] != '\n') m[len++] = '\n';
    len += (size_t)sprintf(m + len, "end crc32c=%08x\n", ckpt_crc32c(0, m, len));
    FILE *f = fopen(path, "wb");
    if (f) fwrite(m, 1, len, f), fclose(f);
    free(m), free(t);
}

static void load(const uint8_t *d, size_t n) {
    char root[400], dir[500];
    snprintf(root, sizeof root, "%s/checkpoints", fuzz_tmp());
    snprintf(dir, sizeof dir, "%s/step_00000002", root);
    fuzz_unpack(root, d, n);
    reseal(dir);
    const struct Layout *l = &layouts[n ? d[0] % NLAYOUT : 0];
    int how = n > 1 ? (d[1] == 'r' ? 0 : d[1] == 'f' ? 1 : d[1] == 'i' ? 2 : d[1] % 3) : 0;
    /* as train.c: a stage's layers (two layers, two stages: one each) */
    ModelOptions mo = {.tp = l->tp, .tp_rank = l->tp_rank, .ep = l->ep, .ep_rank = l->ep_rank, .cp = l->cp,
                       .cp_rank = l->cp_rank};
    if (l->pp > 1) mo.layer_lo = l->pp_rank, mo.layer_hi = l->pp_rank + 1;
    char err[2048];
    if (l->tp > 1 && arch_tp_check(&spec, l->tp, err, sizeof err) != 0) abort(); /* the seeds' model splits */
    Model m;
    model_init(&m, backend_get("cpu"), &spec, &mo);
    if (how == 2) { /* init.from: the parameters alone */
        state_init_from(&m, dir, 0);
        model_free(&m);
        return;
    }
    /* Lion's one moment over this rank's optimizer range (ZeRO-1: half of it) */
    size_t lo = l->zero_half ? m.num_params / 2 : 0, hi = m.num_params;
    AdamW o = {.be = m.be, .kind = OPTIM_LION, .state_bytes = 4, .n = m.num_params, .lo = lo, .hi = hi};
    o.m = xcalloc(hi - lo, sizeof(float));
    CkptTable t;
    ckpt_table_init(&t);
    state_table_add(&t, &m, &o);
    int64_t optim_t = 0, step = 0, tokens = 0;
    double elapsed = 0;
    uint64_t pos[2], rng[4];
    ckpt_add_blob(&t, "optim.step", CKPT_I64, 1, 1, &optim_t);
    ckpt_add_blob(&t, "train.step", CKPT_I64, 1, 1, &step);
    ckpt_add_blob(&t, "train.tokens", CKPT_I64, 1, 1, &tokens);
    ckpt_add_blob(&t, "train.elapsed_s", CKPT_F64, 1, 1, &elapsed);
    ckpt_add_blob(&t, "data.train.pos", CKPT_U64, 2, 0, pos);
    ckpt_add_blob(&t, "rng.train", CKPT_U64, 4, 0, rng);
    CkptInfo info;
    char path[1200];
    int flags = 0;
    if (resume_load(dir, root, &t, yaml, how == 1, &info, path, sizeof path, &flags, NULL, NULL) != 1) abort();
    /* a rank past the first reads its own stream, as state_open does */
    size_t len = 0;
    void *blob = ckpt_read_blob(dir, "rng.train/rank1", &len, err, sizeof err);
    if (!blob) fuzz_check_err("ckpt_read_blob", err);
    free(blob);
    /* and --resume auto over the same folder: `latest`, the listing, a damaged one skipped */
    if (resume_load("auto", root, &t, yaml, how == 1, &info, path, sizeof path, &flags, NULL, NULL) < 0) abort();
    ckpt_table_free(&t);
    free(o.m);
    model_free(&m);
}

FUZZ_NOCOV int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    setup();
    return 0;
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_run(load, d, n, "KILN_FUZZ_CKPTLAYOUT_SHOW");
    return 0;
}
