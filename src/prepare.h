/* prepare: `./train prepare` — text files -> token shards (train_*.bin, val_*.bin)
 * through a tokenizer. Owns the command line of that subcommand and the split;
 * never trains, never touches the model. */
#ifndef KILN_PREPARE_H
#define KILN_PREPARE_H

/* argv[0] is "prepare". Returns the exit code; bad usage exits 2. */
int prepare_main(int argc, char **argv);

#endif
