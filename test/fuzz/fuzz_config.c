/* fuzz_config: the YAML config loader, a file or --set values. An input that
 * starts with "--set\n" is a list of overrides, one a line ("key.path=value",
 * applied over the defaults); any other input is a config file's text. Runs
 * in a child: the loader exits 2 on bad input (fuzz.h). */
#include "config.h"
#include "fuzz.h"

static void load(const uint8_t *d, size_t n) {
    Config c;
    if (n >= 6 && !memcmp(d, "--set\n", 6)) {
        char *text = xmalloc(n - 6 + 1), *save = NULL;
        memcpy(text, d + 6, n - 6);
        text[n - 6] = 0;
        const char *sets[64];
        int k = 0;
        for (char *l = strtok_r(text, "\n", &save); l && k < 64; l = strtok_r(NULL, "\n", &save)) sets[k++] = l;
        cfg_load(&c, NULL, sets, k);
        free(text);
        return;
    }
    cfg_load(&c, fuzz_file("config.yaml", d, n), NULL, 0);
}

FUZZ_NOCOV int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    fuzz_fork(load, d, n);
    return 0;
}
