//go:build !race

package randhex

const raceOn = false
