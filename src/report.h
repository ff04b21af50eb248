/* report: reading run directories after (or during) a run. `./train status
 * RUN_DIR` prints where a run stands; `./train report RUN_DIR...` writes one
 * self-contained HTML page with SVG charts. Reads the files metrics.c writes;
 * never writes into a run directory except the report itself. */
#ifndef KILN_REPORT_H
#define KILN_REPORT_H

/* argv[0] is "status" / "report"; return an exit code. */
int report_status_main(int argc, char **argv);
int report_html_main(int argc, char **argv);
/* The HTML report of runs dirs[0..n) into `out`; 0, or -1 if it cannot be
 * written (a directory without a run exits 2, as the command does). */
int report_write_html(const char *const *dirs, int n, const char *out);

#endif
