//! Unit tests of `e2b`.

use super::*;

#[test]
fn queries_decode_as_forms_and_metadata_twice() {
    let q = form_decode("path=%2Fhome%2Fuser%2Fa+b&metadata=env%3Ddev%26k%3Dv");
    assert_eq!(q[0], ("path".into(), "/home/user/a b".into()));
    let inner = form_decode(&q[1].1);
    assert_eq!(inner, vec![("env".into(), "dev".into()), ("k".into(), "v".into())]);
    assert_eq!(percent_decode("%zz%41"), "%zzA");
}
