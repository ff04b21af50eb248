/* compare: `./train compare RUN_A RUN_B [RUN...]`, runs side by side in the
 * terminal (docs/metrics.md "./train compare"). Reads run directories only. */
#ifndef KILN_COMPARE_H
#define KILN_COMPARE_H

/* argv[0] is "compare"; returns an exit code (2: fewer than two runs, or a
 * directory that holds no run). */
int compare_main(int argc, char **argv);

#endif
