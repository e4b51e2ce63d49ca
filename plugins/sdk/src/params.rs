//! Typed access to the string parameters from the policy spec's `[params]` table.

use std::fmt::Display;
use std::str::FromStr;

/// The policy spec's `[params]`, as handed to `init` in [`InitArgs::params`](crate::InitArgs).
///
/// Values are parsed on request with [`FromStr`], after trimming surrounding whitespace.
/// Every error names the key and the offending value, ready to return from `init`:
///
/// ```
/// use tokwatt_policy_sdk::Params;
///
/// let pairs = vec![("step_w".to_string(), "25".to_string())];
/// let params = Params::new(&pairs);
/// assert_eq!(params.get("step_w", 50.0), Ok(25.0));
/// assert_eq!(params.get("window_ticks", 5_u32), Ok(5));
/// assert!(params.get::<u32>("step_w", 1).is_ok());
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Params<'a> {
    pairs: &'a [(String, String)],
}

impl<'a> Params<'a> {
    /// Wraps the `(key, value)` pairs from `init`'s arguments.
    pub fn new(pairs: &'a [(String, String)]) -> Self {
        Params { pairs }
    }

    /// The value written for `key`, untrimmed; the last one if the key repeats.
    pub fn raw(&self, key: &str) -> Option<&'a str> {
        self.pairs
            .iter()
            .rev()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.as_str())
    }

    /// The value for `key` parsed as `T`, or `default` when the key is absent.
    ///
    /// # Errors
    /// When the value does not parse as `T`; the message names the key, the value and
    /// the expected type.
    pub fn get<T>(&self, key: &str, default: T) -> Result<T, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        Ok(self.get_optional(key)?.unwrap_or(default))
    }

    /// The value for `key` parsed as `T`, or `None` when the key is absent.
    ///
    /// # Errors
    /// As [`Params::get`].
    pub fn get_optional<T>(&self, key: &str) -> Result<Option<T>, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        let Some(value) = self.raw(key) else {
            return Ok(None);
        };
        value.trim().parse::<T>().map(Some).map_err(|error| {
            format!(
                "parameter `{key}` = {value:?} is not a valid {}: {error}",
                std::any::type_name::<T>()
            )
        })
    }

    /// Checks that every key is one of `known`, so a misspelt parameter in a spec is an
    /// error rather than a silently ignored setting.
    ///
    /// # Errors
    /// Names the first unknown key and lists the known ones.
    pub fn check_known(&self, known: &[&str]) -> Result<(), String> {
        match self
            .pairs
            .iter()
            .find(|(name, _)| !known.contains(&name.as_str()))
        {
            None => Ok(()),
            Some((name, _)) => Err(format!(
                "unknown parameter `{name}`; this policy takes: {}",
                if known.is_empty() {
                    "no parameters".to_string()
                } else {
                    known.join(", ")
                }
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn parses_present_values_and_defaults_absent_ones() {
        let pairs = pairs(&[("step_w", " 25.5 "), ("window_ticks", "7")]);
        let params = Params::new(&pairs);
        assert_eq!(params.get("step_w", 50.0), Ok(25.5));
        assert_eq!(params.get("window_ticks", 5_u32), Ok(7));
        assert_eq!(params.get("min_step_w", 10.0), Ok(10.0));
        assert_eq!(params.get_optional::<u32>("batch_size"), Ok(None));
    }

    #[test]
    fn a_bad_value_names_the_key_the_value_and_the_type() {
        let pairs = pairs(&[("window_ticks", "five")]);
        let error = Params::new(&pairs)
            .get("window_ticks", 5_u32)
            .expect_err("\"five\" is not a u32");
        assert!(error.contains("`window_ticks`"), "{error}");
        assert!(error.contains("\"five\""), "{error}");
        assert!(error.contains("u32"), "{error}");
    }

    #[test]
    fn the_last_of_repeated_keys_wins() {
        let pairs = pairs(&[("step_w", "10"), ("step_w", "20")]);
        assert_eq!(Params::new(&pairs).get("step_w", 0.0), Ok(20.0));
    }

    #[test]
    fn unknown_keys_are_reported_with_the_known_ones() {
        let pairs = pairs(&[("step_w", "10"), ("stepw", "20")]);
        let params = Params::new(&pairs);
        let error = params
            .check_known(&["step_w", "min_step_w"])
            .expect_err("stepw is misspelt");
        assert!(error.contains("`stepw`"), "{error}");
        assert!(error.contains("step_w, min_step_w"), "{error}");
        assert_eq!(params.check_known(&["step_w", "stepw"]), Ok(()));
        let none = Params::new(&[]);
        assert_eq!(none.check_known(&[]), Ok(()));
    }
}
