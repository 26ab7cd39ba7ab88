package core

// OptionError names an option out of range. Its text is
// "<Options>: <Field> is invalid, want <Want>", as in
// "relay options: BatchSize is invalid, want 0 (the default) to 10000".
type OptionError struct {
	Options string // whose options, such as "relay options"
	Field   string // the field's name in its Go struct, such as "BatchSize"
	Want    string // the values it takes
}

func (e *OptionError) Error() string {
	return e.Options + ": " + e.Field + " is invalid, want " + e.Want
}

// OptionCheck is one range check of an options struct, for CheckOptions.
type OptionCheck struct {
	Field, Want string
	Bad         bool // the field is out of range
}

// CheckOptions returns an *OptionError for the first bad check, or nil;
// options names whose options they are. Options.WithDefaults uses it, and
// so can a source's own options.
func CheckOptions(options string, checks ...OptionCheck) error {
	for _, c := range checks {
		if c.Bad {
			return &OptionError{Options: options, Field: c.Field, Want: c.Want}
		}
	}
	return nil
}
