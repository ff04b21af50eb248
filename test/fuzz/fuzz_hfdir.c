/* fuzz_hfdir: init.from of a whole HuggingFace directory (src/hf.c,
 * hf_init_from): config.json beside model.safetensors, or a sharded
 * model.safetensors.index.json and its shards, against a tiny model of each
 * HF family kiln maps (gpt2, llama, olmoe). The input is the directory:
 *   MODEL            first byte, the model: 'g' gpt2, 'l' llama, 'o' olmoe (else by value mod 3)
 *   \n@@@NAME\nBYTES  a file NAME holding BYTES (up to the next "\n@@@")
 *   \n@@@NAME/\n     a directory NAME (a directory where a file should be)
 * (fuzz.h, fuzz_unpack: the files land inside the directory; the index
 * itself may name ../ or /abs paths, and those must be refused). Runs in a
 * child (hf_init_from exits 2 on a bad directory). KILN_FUZZ_HFDIR_SEEDS=DIR writes the seeds from
 * kiln's own writer (hf_write_dir): each model whole, sharded, and bf16;
 * KILN_FUZZ_HFDIR_SHOW=1 with one input runs it here, printing kiln's answer. */
#include "arch.h"
#include "backend.h"
#include "config.h"
#include "fuzz.h"
#include "hf.h"
#include "model.h"

static Model models[3];
static ArchSpec specs[3];
static int ready;

static const char *sets[3][14] = {
    {"model.arch=gpt2", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.seq_len=8",
     "model.vocab_size=70", NULL},
    {"model.arch=llama", "model.n_layer=1", "model.n_head=2", "model.n_kv_head=1", "model.n_embd=16",
     "model.ffn_hidden=24", "model.seq_len=8", "model.vocab_size=70", NULL},
    {"model.arch=llama", "model.n_layer=1", "model.n_head=2", "model.n_kv_head=1", "model.n_embd=16",
     "model.seq_len=8", "model.vocab_size=70", "model.mlp=moe", "model.moe.n_experts=2", "model.moe.top_k=1",
     "model.moe.n_shared=0", "model.moe.expert_hidden=16", "model.qk_norm=full"},
};

FUZZ_NOCOV static void setup(void) {
    if (ready) return;
    for (int i = 0; i < 3; i++) {
        Config c;
        int k = 0;
        while (k < 14 && sets[i][k]) k++;
        cfg_load(&c, NULL, sets[i], k);
        arch_from_config(&c, &specs[i]);
        model_init(&models[i], backend_get("cpu"), &specs[i], NULL);
        model_init_weights(&models[i], 1 + (uint64_t)i);
    }
    ready = 1;
}

static void load(const uint8_t *d, size_t n) {
    char dir[400];
    snprintf(dir, sizeof dir, "%s/hf", fuzz_tmp());
    fuzz_unpack(dir, d, n);
    int which = n ? (d[0] == 'g' ? 0 : d[0] == 'l' ? 1 : d[0] == 'o' ? 2 : d[0] % 3) : 0;
    hf_init_from(&models[which], dir, 0);
}

/* The seeds: kiln's own export of each model, packed as load() reads them. */
FUZZ_NOCOV static int by_name(const struct dirent **x, const struct dirent **y) { return strcmp((*x)->d_name, (*y)->d_name); }

FUZZ_NOCOV static void pack(const char *out, const char *name, int which, const char *dir) {
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", out, name);
    FILE *o = fopen(path, "wb");
    if (!o) abort();
    fputc("glo"[which], o);
    struct dirent **e;
    int ne = scandir(dir, &e, NULL, by_name);
    for (int i = 0; i < ne; i++) {
        char src[1200];
        snprintf(src, sizeof src, "%s/%s", dir, e[i]->d_name);
        size_t len;
        char *t = e[i]->d_name[0] != '.' && strstr(e[i]->d_name, "generation") == NULL ? kiln_read_file(src, &len) : NULL;
        if (t) {
            fprintf(o, "\n@@@%s\n", e[i]->d_name);
            fwrite(t, 1, len, o);
            free(t);
        }
        free(e[i]);
    }
    free(e);
    fclose(o);
}

FUZZ_NOCOV static void write_seeds(const char *out) {
    for (int i = 0; i < 3; i++) {
        Model *m = &models[i];
        int nt = 0;
        ArchTensor *t = arch_tensors(&specs[i], 0, &nt);
        float **host = xcalloc((size_t)nt, sizeof *host);
        float *all = xmalloc(m->num_params * sizeof(float));
        model_params_to_host(m, all);
        for (int j = 0; j < nt; j++) {
            if (strcmp(t[j].name, m->params[j].name)) abort(); /* the table's order is the model's */
            host[j] = all + m->params[j].offset;
        }
        for (int v = 0; v < 3; v++) {
            char dir[600], name[64];
            snprintf(dir, sizeof dir, "%s/seed-%d-%d", fuzz_tmp(), i, v);
            hf_write_dir(&specs[i], t, nt, host, dir, v == 2 ? ST_BF16 : ST_F32, v == 1 ? 1500 : 0);
            snprintf(name, sizeof name, "%s_%s", (const char *[]){"gpt2", "llama", "olmoe"}[i], v == 0 ? "whole" : v == 1 ? "sharded" : "bf16");
            pack(out, name, i, dir);
        }
        free(host), free(all), free(t);
    }
}

FUZZ_NOCOV int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    setup();
    if (getenv("KILN_FUZZ_HFDIR_SEEDS")) {
        write_seeds(getenv("KILN_FUZZ_HFDIR_SEEDS"));
        exit(0);
    }
    return 0;
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_run(load, d, n, "KILN_FUZZ_HFDIR_SHOW");
    return 0;
}
