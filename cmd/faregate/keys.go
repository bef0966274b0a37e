package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"faregate/protect/policy"
	"faregate/protect/principal"
)

// runKeys implements `faregate keys new -id ID -tier TIER`: a fresh API
// key, shown once, and the policy line that holds only its SHA-256. It
// needs no policy file: the operator pastes the line into it.
func runKeys(args []string, stdout io.Writer) error {
	const usage = "usage: faregate keys new -id ID -tier TIER"
	if len(args) == 0 || args[0] != "new" {
		return errors.New(usage)
	}
	fs := flag.NewFlagSet("keys new", flag.ContinueOnError)
	fs.SetOutput(stdout)
	id := fs.String("id", "", "the key's id in the policy: [a-z0-9_-]{1,64}, unique")
	tier := fs.String("tier", "", "the key's tier: [a-z0-9_-]{1,32}, defined under tiers: in the policy, not public")
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	var problems []error
	if fs.NArg() > 0 {
		problems = append(problems, fmt.Errorf("keys new: unexpected arguments %q (%s)", fs.Args(), usage))
	}
	if !policy.ValidKeyID(*id) {
		problems = append(problems, fmt.Errorf("keys new: -id %q: want [a-z0-9_-]{1,64}", *id))
	}
	switch {
	case !policy.ValidTierName(*tier):
		problems = append(problems, fmt.Errorf("keys new: -tier %q: want [a-z0-9_-]{1,32}", *tier))
	case *tier == principal.PublicTier:
		problems = append(problems, errors.New("keys new: -tier public: the public tier is the anonymous lane and takes no keys"))
	}
	if len(problems) > 0 {
		return errors.Join(problems...)
	}

	key := policy.NewKey()
	// The key is printed here and nowhere else: faregate keeps only its
	// hash, so a lost key is replaced, never recovered.
	_, err := fmt.Fprintf(stdout, `API key for %[1]s (tier %[2]s), shown only this once; give it to its holder now:

    %[3]s

Policy line, under keys: in FAREGATE_POLICY_FILE (only the sha256 goes into the policy, never the key):

  - {id: %[1]s, sha256: "%[4]s", tier: %[2]s}
`, *id, *tier, key, policy.HashKey(key))
	return err
}
