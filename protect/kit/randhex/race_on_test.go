//go:build race

package randhex

// raceOn: the race detector changes what escapes, so allocation counts differ.
const raceOn = true
