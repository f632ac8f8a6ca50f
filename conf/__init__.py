"""dflash's YAML configs, importable as the package `dflash.conf` (dflash/conf links here; a wheel
carries the files in that package), which is how every command finds them: Hydra reads a
config package only where it holds this file."""
